"""A frozen engine core (SIGSTOP): its frontends notice the silence, fail the requests they hold
with `unavailable`, refuse new ones and report unhealthy, saying why; once it runs again
(SIGCONT) service resumes by itself, with nothing of the failed requests left running."""

from __future__ import annotations

import http.client
import json
import os
import signal
import threading
import time
from urllib.parse import urlsplit

from protocol import Client, RequestError


def health(cluster) -> tuple[int, dict]:
    url = urlsplit(cluster.http)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    try:
        conn.request("GET", "/health")
        r = conn.getresponse()
        return r.status, json.loads(r.read())
    finally:
        conn.close()


def test_a_stopped_core_fails_requests_at_once_and_service_resumes_when_it_continues(launch):
    cluster = launch("--model", "synthetic:tiny", "--http", "127.0.0.1:0")
    outcome: dict = {}
    streaming = threading.Event()

    def stream() -> None:
        try:
            with Client(cluster.endpoint, timeout=600) as c:
                for _ in c.stream(prompt_token_ids=[1, 2, 3], max_tokens=4000, ignore_eos=True):
                    streaming.set()
        except RequestError as e:
            outcome["error"], outcome["at"] = e, time.monotonic()

    thread = threading.Thread(target=stream)
    thread.start()
    assert streaming.wait(60)
    core = cluster.proc.pid
    os.kill(core, signal.SIGSTOP)
    stopped_at = time.monotonic()
    try:
        thread.join(600)
        error = outcome["error"]
        assert error.code == "unavailable" and "stopped" in error.message, error
        # the client's own timeout (600 s) is what this rules out; measured: about 3 s
        assert outcome["at"] - stopped_at < 60
        with Client(cluster.endpoint, timeout=600) as c:
            try:
                c.generate(prompt_token_ids=[5, 6], max_tokens=2)
            except RequestError as e:
                refused = e
        assert refused.code == "unavailable" and "stopped" in refused.message
        code, body = health(cluster)
        assert code == 503 and "stopped" in json.dumps(body), body
    finally:
        os.kill(core, signal.SIGCONT)
    deadline = time.monotonic() + 60
    while True:  # the first answer from the core brings the frontend back
        try:
            with Client(cluster.endpoint, timeout=60) as c:
                again = c.generate(prompt_token_ids=[5, 6], max_tokens=3, ignore_eos=True)
                status = c.status()
            break
        except RequestError:
            assert time.monotonic() < deadline, "service did not resume"
            time.sleep(0.2)
    assert len(again.choices[0].token_ids) == 3
    while status["requests"]["running"] or status["pool"]["pages_used"]:  # the stream's work
        assert time.monotonic() < deadline, status["requests"]  # was cancelled in the core
        time.sleep(0.2)
        with Client(cluster.endpoint, timeout=60) as c:
            status = c.status()
    assert health(cluster)[0] == 200
