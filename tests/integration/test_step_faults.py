"""The coordinator against a scripted worker: a corrupt restore fails only its own request."""

import threading

import zmq
from helpers.remote import free_port

from coordinator.local_cluster import LocalCluster
from protocol import Client, RequestError, security
from protocol.messages import (
    Assign,
    Heartbeat,
    ModelInfo,
    Ready,
    Register,
    Step,
    StepError,
    StepResult,
)
from protocol.wire import decode, encode
from worker.tokenizer import byte_level_tokenizer


class FakeWorker(threading.Thread):
    """One worker holding every layer; samples token 65 ('A') and fails the first restore."""

    def __init__(self, endpoint: str, keys: str):
        super().__init__(daemon=True)
        self.endpoint = endpoint
        self.keys = keys
        self.stop = threading.Event()
        self.failed_seq: int | None = None

    def run(self) -> None:
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        security.secure_client(sock, self.keys)
        sock.connect(self.endpoint)
        sock.send_multipart(encode(Register(rank=0, device="cpu", data_endpoint="tcp://x:1")))
        tok = byte_level_tokenizer(512)
        while not self.stop.is_set():
            if not sock.poll(100):
                sock.send_multipart(encode(Heartbeat(rank=0)))
                continue
            msg, _ = decode(sock.recv_multipart())
            if isinstance(msg, Assign):
                info = ModelInfo(name="fake", n_layers=4, vocab_size=512, max_context=4096,
                                 tokenizer_json=tok.tokenizer_json, eos_ids=tok.eos_ids)
                sock.send_multipart(encode(Ready(rank=0, layer_start=0, layer_end=4,
                                                 model=info)))
            elif isinstance(msg, Step):
                restored = [m.id for m in msg.restore]
                if restored and self.failed_seq is None:
                    self.failed_seq = restored[0]
                    sock.send_multipart(encode(StepError(
                        step=msg.step, code="internal", seq_ids=[restored[0]],
                        message=f"sequence {restored[0]}: the park store does not hold it")))
                    continue
                sampled = [s.id for s in msg.seqs if s.sample]
                sock.send_multipart(encode(StepResult(step=msg.step, seq_ids=sampled,
                                                      tokens=[65] * len(sampled))))
            sock.send_multipart(encode(Heartbeat(rank=0)))
        sock.close()


def test_a_corrupt_restore_fails_its_request_and_the_others_complete(tmp_path):
    keys = str(security.generate_keys(tmp_path / "keys"))
    port = free_port()
    worker = FakeWorker(f"tcp://127.0.0.1:{port}", keys)
    worker.start()
    cluster = LocalCluster("--workers", "1", "--worker-listen", f"tcp://127.0.0.1:{port}",
                           "--preempt-every", "2", "--page-size", "2", "--curve-keys", keys,
                           command="coordinator", timeout=60)
    cluster.start()
    try:
        outcomes = {}

        def run(i: int) -> None:
            try:
                with Client(cluster.endpoint, timeout=60, curve_keys_dir=keys) as c:
                    outcomes[i] = c.generate(prompt_token_ids=[70 + i] * 3, max_tokens=12,
                                             ignore_eos=True)
            except RequestError as e:
                outcomes[i] = e

        threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(600)
        errors = [r for r in outcomes.values() if isinstance(r, RequestError)]
        done = [r for r in outcomes.values() if not isinstance(r, RequestError)]
        assert len(errors) == 1 and errors[0].code == "internal"
        assert "park store" in errors[0].message
        assert len(done) == 2 and all(r.token_ids == [65] * 12 for r in done)
        with Client(cluster.endpoint, timeout=30, curve_keys_dir=keys) as c:
            s = c.status()
        assert s["pool"]["pages_used"] == 0 and s["park"]["slots_used"] == 0
        assert s["requests"] == {"running": 0, "waiting": 0, "parked": 0}
    finally:
        cluster.stop()
        worker.stop.set()
