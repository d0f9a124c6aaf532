"""The CLI against real clusters: generate's and chat's options and chat's commands, Ctrl-C on a
launch's process group (drains, no respawn, exit 0), and a pool too large for memory refused
naming its flag."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from coordinator.local_cluster import LocalCluster
from protocol import Client


def siding(*args: str, stdin: str | None = None, timeout: float = 120
           ) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "coordinator", *args], input=stdin,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def real(launch) -> LocalCluster:
    return launch("--workers", "1")


def test_generate_takes_n_stop_ignore_eos_and_a_system_prompt(real):
    r = siding("generate", "Once upon a time", "--endpoint", real.endpoint, "-n", "2",
               "--temperature", "1", "--seed", "7", "--max-tokens", "8", "--ignore-eos", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert [len(c["token_ids"]) for c in out["choices"]] == [8, 8]
    assert out["choices"][0]["token_ids"] != out["choices"][1]["token_ids"]
    logged = f"request {out['request_id']}: {len(out['prompt_token_ids'])} prompt + 16 output "
    deadline = time.monotonic() + 60  # written after the result is sent
    while not any(logged in line and "ttft" in line for line in real.stderr):
        assert time.monotonic() < deadline, real.stderr
        time.sleep(0.05)
    plain = json.loads(siding("generate", "Hi", "--endpoint", real.endpoint, "--json",
                              "--max-tokens", "1").stdout)
    system = json.loads(siding("generate", "Hi", "--endpoint", real.endpoint, "--json",
                               "--max-tokens", "1", "--system", "You are terse.").stdout)
    assert len(system["prompt_token_ids"]) > len(plain["prompt_token_ids"]) + 4
    first = json.loads(siding("generate", "Once upon a time", "--endpoint", real.endpoint,
                              "--json", "--max-tokens", "24", "--ignore-eos").stdout)["text"]
    word = first.split()[2]
    stopped = json.loads(siding("generate", "Once upon a time", "--endpoint", real.endpoint,
                                "--json", "--max-tokens", "24", "--ignore-eos", "--stop",
                                word).stdout)
    assert stopped["finish_reason"] == "stop" and stopped["text"] == first[:first.index(word)]


def test_chat_has_commands(real):
    r = siding("chat", "--endpoint", real.endpoint, "--max-tokens", "4",
               stdin="/help\n/system Answer in French.\n/nonsense\nHello\n/reset\n/exit\nnever\n")
    assert r.returncode == 0, r.stderr
    assert "/reset" in r.stdout and "(system prompt set; starting over)" in r.stdout
    assert "unknown command /nonsense" in r.stdout and "(the conversation starts over)" in r.stdout


def test_ctrl_c_on_the_launch_drains_without_respawning_and_exits_0():
    cluster = LocalCluster("--model", "synthetic:tiny", "--workers", "2", timeout=300)
    cluster.start()
    try:
        got: dict = {}

        def one() -> None:
            with Client(cluster.endpoint, timeout=600) as c:
                got["r"] = c.generate(prompt_token_ids=[1, 2, 3], max_tokens=300,
                                      ignore_eos=True)

        t = threading.Thread(target=one)
        t.start()
        time.sleep(1.0)
        with Client(cluster.endpoint, timeout=30) as c:  # every rank's forward time
            assert all(w["forward_seconds_mean"] for w in c.status()["workers"])
        os.killpg(cluster.proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
        t.join(600)
        code = cluster.proc.wait(60)
    finally:
        cluster.stop()
    err = "".join(cluster.stderr)
    assert len(got["r"].token_ids) == 300, err
    assert code == 0 and "Traceback" not in err and "restarting" not in err, err
    assert "draining" in err


def test_a_pool_too_large_for_memory_is_refused_naming_the_flag():
    r = siding("launch", "--kv-pages", str(1 << 30))
    assert r.returncode == 1 and f"--kv-pages must be at most {1 << 24}" in r.stderr, r.stderr
    r = siding("launch", "--kv-pages", "4000000", "--listen", "tcp://127.0.0.1:*",
               "--worker-listen", "tcp://127.0.0.1:*", "--metrics-port", "0", timeout=300)
    assert r.returncode == 1
    assert "--kv-pages 4000000:" in r.stderr and "GiB of host memory" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_status_shows_the_prefix_cache(real):
    siding("generate", "Once upon a time", "--endpoint", real.endpoint, "--max-tokens", "2")
    r = siding("status", "--endpoint", real.endpoint)
    assert r.returncode == 0 and "prompt tokens cached" in r.stdout, r.stdout


class Terminal:
    """A `siding chat` on pipes: lines in, everything it prints gathered as it comes."""

    def __init__(self, *args: str):
        self.proc = subprocess.Popen([sys.executable, "-m", "coordinator", "chat", *args],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, bufsize=1)
        self.out = ""
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        while text := self.proc.stdout.read(1):
            self.out += text

    def send(self, line: str) -> None:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def wait_for(self, done, what: str) -> None:
        deadline = time.monotonic() + 60
        while not done(self.out):
            assert time.monotonic() < deadline and self.proc.poll() is None, (what, self.out)
            time.sleep(0.02)


def logged_prompts(cluster: LocalCluster, ending: str) -> list[int]:
    """The prompt tokens of each request the request log says ended so."""
    return [int(line.split(": ", 1)[1].split()[0]) for line in cluster.stderr
            if f", {ending}, " in line]


def test_ctrl_c_stops_a_chat_reply_and_the_conversation_goes_on(real):
    chat = Terminal("--endpoint", real.endpoint, "--max-tokens", "4000", "--ignore-eos")
    try:
        chat.send("Hello")
        chat.wait_for(lambda out: len(out) > 12, "the first reply")
        chat.proc.send_signal(signal.SIGINT)  # what a terminal's Ctrl-C does
        chat.wait_for(lambda out: "(reply stopped)\n> " in out, "the first stop")
        first = chat.out.split("\n(reply stopped)")[0].removeprefix("> ")
        chat.send("Again")
        chat.wait_for(lambda out: len(out.split("(reply stopped)\n> ")[1]) > 2, "a second reply")
        chat.proc.send_signal(signal.SIGINT)
        chat.wait_for(lambda out: out.count("(reply stopped)") == 2, "the second stop")
        chat.proc.stdin.close()  # Ctrl-D
        assert chat.proc.wait(60) == 0, chat.proc.stderr.read()
    finally:
        chat.proc.kill()
    assert "Traceback" not in chat.proc.stderr.read()
    deadline = time.monotonic() + 60
    while len(aborted := logged_prompts(real, "aborted (by the client)")) < 2:
        assert time.monotonic() < deadline, real.stderr
        time.sleep(0.05)
    with Client(real.endpoint) as c:  # the second request's prompt: the first reply as shown
        expected = c.chat([{"role": "user", "content": "Hello"},
                           {"role": "assistant", "content": first},
                           {"role": "user", "content": "Again"}], max_tokens=1)
    assert aborted[-1] == len(expected.prompt_token_ids)
