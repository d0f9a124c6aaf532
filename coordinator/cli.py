"""The `siding` command: launch a cluster, run pieces separately, talk to a running one."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading

import msgspec

from protocol.help_formatter import HelpFormatter
from protocol.sampling import SamplingParams
from protocol.worker_config import DTYPES, KV_MODES, OVERLAP, WorkerConfig

from .config import is_endpoint

DEFAULT_ENDPOINT = "tcp://127.0.0.1:5555"
LOG_LEVELS = ("debug", "info", "warning", "error")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["worker"]:  # the worker parses its own flags, in its own package
        os.execv(sys.executable, [sys.executable, "-m", "worker", *argv[1:]])
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        raise SystemExit(2)
    if args.debug:
        args.log_level = "debug"
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        args.func(args)
        sys.stdout.flush()  # here, so that a closed pipe is caught below
    except KeyboardInterrupt:
        raise SystemExit(130) from None
    except BrokenPipeError:  # `siding status | head -1`: the reader has all it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise SystemExit(1) from None
    except Exception as e:
        if args.debug:
            raise
        print(f"siding: error: {e}", file=sys.stderr)
        raise SystemExit(1) from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="siding", description="siding: distributed LLM inference",
                                formatter_class=HelpFormatter)
    p.add_argument("--debug", action="store_true", help="show tracebacks and debug logs")
    p.add_argument("--log-level", choices=LOG_LEVELS, default="info",
                   help="what the cluster's processes log (info: a line per finished request)")
    # `--debug` after the command works too; SUPPRESS keeps it from undoing one before it.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                        help="show tracebacks and debug logs")
    common.add_argument("--log-level", choices=LOG_LEVELS, default=argparse.SUPPRESS,
                        help="what the cluster's processes log (info: a line per finished "
                        "request; default: info)")
    sub = p.add_subparsers(metavar="COMMAND")

    def command(name: str, **options) -> argparse.ArgumentParser:
        return sub.add_parser(name, parents=[common], formatter_class=HelpFormatter, **options)

    launch = command("launch", help="start a coordinator and local workers")
    _cluster_args(launch)
    launch.set_defaults(func=cmd_launch, spawn=True)

    coord = command("coordinator", help="start a coordinator that waits for workers")
    _cluster_args(coord)
    coord.set_defaults(func=cmd_launch, spawn=False)

    command("worker", help="start a worker (see `siding worker --help`)")

    gen = command("generate", help="complete a prompt")
    gen.add_argument("prompt", help="the text to complete (with --system: a user message)")
    _endpoint(gen)
    _sampling_args(gen)
    gen.add_argument("--stream", action="store_true", help="print the text as it is generated")
    gen.add_argument("--json", action="store_true", help="print the whole result as JSON")
    gen.set_defaults(func=cmd_generate)

    chat = command("chat", help="chat interactively, streaming replies",
                   description="chat with the model; type /help for the commands")
    _endpoint(chat)
    _sampling_args(chat, max_tokens=256, skip=("n",))
    chat.set_defaults(func=cmd_chat)

    status = command("status", help="show a running cluster")
    _endpoint(status)
    status.add_argument("--json", action="store_true", help="print the whole status as JSON")
    status.set_defaults(func=cmd_status)

    demo = command("demo", help="launch on the default model, run prompts, stop")
    demo.add_argument("--model", default="smollm2-135m", help="the model to launch")
    demo.add_argument("--workers", type=int, default=2, help="worker processes (layer split)")
    demo.set_defaults(func=cmd_demo)

    bench = command("bench", help="benchmarks; results under bench-results/",
                           description="run a benchmark scenario (a module of `benchmarks`): "
                           "decode, ...; `siding bench SCENARIO --help` lists its options")
    bench.add_argument("scenario", help="the benchmark to run (decode, serve, prefix, ...)")
    bench.add_argument("rest", nargs=argparse.REMAINDER, help="the scenario's own options")
    bench.set_defaults(func=cmd_bench)

    keys = command("keys", help="write CURVE key pairs for non-loopback binds")
    keys.add_argument("dir", help="the directory to write them to")
    keys.set_defaults(func=cmd_keys)
    return p


def _endpoint(p: argparse.ArgumentParser) -> None:
    p.add_argument("--endpoint", type=endpoints, default=DEFAULT_ENDPOINT,
                   help="the cluster's client endpoint (what `siding launch` printed as ready): "
                   "tcp://HOST:PORT, HOST:PORT or ipc:///path; a comma-separated list takes one")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds to wait for the whole request (a server that sends nothing at "
                   "all for 3 s is reported gone at once)")
    p.add_argument("--curve-keys", default=None,
                   help="CURVE keys directory, for a cluster started with --curve-keys")


def endpoints(text: str) -> str:
    """`--endpoint`: endpoints, comma-separated; HOST:PORT means tcp://HOST:PORT."""
    given = [e.strip() for e in text.split(",")]
    full = [e if "://" in e else f"tcp://{e}" for e in given]
    for e, f in zip(given, full):
        if not is_endpoint(f):
            raise argparse.ArgumentTypeError(
                f"{e!r} is not an endpoint: give tcp://HOST:PORT, HOST:PORT or ipc:///path")
    return ",".join(full)


def _sampling_args(p: argparse.ArgumentParser, max_tokens: int = 64,
                   skip: tuple[str, ...] = ()) -> None:
    """A flag for each of `SamplingParams`' fields but `skip` (`n` is `-n`), with the type's
    default (`max_tokens`'s is the command's) and meaning."""
    kinds = msgspec.inspect
    for f in kinds.type_info(SamplingParams).fields:
        if f.name in skip:
            continue
        t = f.type
        if isinstance(t, kinds.UnionType):  # X | None
            (t,) = [u for u in t.types if not isinstance(u, kinds.NoneType)]
        flag = "-n" if f.name == "n" else "--" + f.name.replace("_", "-")
        a = {"dest": f.name, "help": t.extra_json_schema["description"]}
        if isinstance(t.type, kinds.BoolType):
            a["action"] = "store_true"
        elif isinstance(t.type, kinds.ListType):
            one = int if isinstance(t.type.item_type, kinds.IntType) else str
            a.update(action="append", type=one, metavar="ID" if one is int else "TEXT")
        else:
            a.update(type=int if isinstance(t.type, kinds.IntType) else float,
                     default=max_tokens if f.name == "max_tokens" else f.default)
        p.add_argument(flag, **a)
    p.add_argument("--system", default=None, metavar="TEXT",
                   help="a system prompt (generate: the prompt becomes a chat's user message)")


def _cluster_args(p: argparse.ArgumentParser) -> None:
    a = p.add_argument
    a("--model", default="smollm2-135m",
      help="smollm2-135m, a .gguf path, a Hugging Face directory, or synthetic:NAME")
    a("--workers", type=int, default=1, metavar="N",
      help="worker processes; the model's layers are split evenly between them")
    a("--devices", default="cpu", help="cpu, or cuda:0,cuda:1,... one per worker")
    a("--dtype", default="auto", choices=DTYPES,
      help="weights and KV (auto: float32 on a CPU, bfloat16 on CUDA)")
    a("--kv", default="device", choices=KV_MODES,
      help="where the KV pages live: device memory, or host memory streamed through a ring")
    a("--pipeline-depth", type=int, default=1, metavar="D",
      help="--kv host: layers the staging ring delivers ahead of the one computing")
    a("--ring-budget-mib", type=int, default=512, metavar="MIB",
      help="--kv host: device memory the staging ring may take (0: no cap)")
    a("--exact", action="store_true",
      help="batch-invariant kernels: a sequence's tokens are byte-identical however it is "
      "batched, preempted or split")
    a("--no-cuda-graphs", dest="cuda_graphs", action="store_false",
      help="run CUDA steps eagerly instead of replaying captured graphs")
    a("--overlap", default="auto", choices=OVERLAP,
      help="plan each step before the tokens of the one before are back; the worker takes "
      "them from its device (auto: on for CUDA devices, where it pays; off on a CPU)")
    a("--busy-poll", type=_busy_poll, default=None, metavar="SECONDS",
      help="after each message, poll sockets in a loop for this long before sleeping: a "
      "request's first token skips the cold wake of each process it crosses, at the cost of a "
      "core per process while it spins (default auto: 1 s where the workers run on CUDA "
      "devices, else 0)")
    a("--transport-delay-ms", type=float, default=0.0, help=argparse.SUPPRESS)  # tests only
    a("--page-size", type=int, default=16, metavar="TOKENS", help="tokens per KV page")
    a("--kv-pages", type=int, default=1024, metavar="N",
      help="KV pages in each worker's pool (its memory: pages x page size x layers x KV heads "
      "x head size x 2 x dtype bytes)")
    a("--park-pages", type=int, default=None, metavar="N",
      help="host park store slots per worker (default: as many as --kv-pages)")
    a("--max-batch-seqs", type=int, default=64, metavar="N", help="sequences in one step")
    a("--max-batch-tokens", type=int, default=512, metavar="N",
      help="rows in one step (prompt chunks and decodes together)")
    a("--no-prefix-cache", dest="prefix_cache", action="store_false",
      help="compute every prompt in full, instead of reusing the KV pages of a prefix already "
      "computed (cached pages are reused last, and reclaimed before anyone is preempted)")
    a("--preempt-every", type=int, default=0, metavar="K",
      help="testing: park every sequence every K decode steps (0: never)")
    a("--max-queued-per-client", type=int, default=1024,
      help="requests one client may have queued (not yet running); past it, `overloaded`. "
      "The queue is fair between clients (a client: a connection, or the request's `user`)")
    a("--prefill-hold-ms", type=int, default=0,
      help="while sequences decode, new prompts wait up to this long (or until they fill half "
      "a step's rows) and prefill together, so most steps decode only: throughput for TTFT")
    a("--multi-step", type=int, default=1, metavar="K",
      help="plan steps in groups of K, each on the tokens of the one before it, and hear of a "
      "group's results at once (one worker only): the engine core's and frontends' CPU per "
      "step and per message divided by K, for tokens streamed K at a time")
    a("--listen", default=DEFAULT_ENDPOINT, metavar="ENDPOINT",
      help="client endpoint; with --frontends N, up to N comma-separated (frontends past them "
      "take ports of the system's choosing on the first one's host)")
    a("--frontends", type=int, default=1, metavar="N",
      help="frontend processes (client sockets, tokenization, text, streaming); `ready` lists "
      "their endpoints, comma-separated, and clients given that list spread over them")
    a("--http", default=None, metavar="HOST:PORT",
      help="also serve the OpenAI-compatible HTTP API there (for example 127.0.0.1:8000; off "
      "unless given); every frontend serves it, sharing the port")
    a("--sse-keepalive", type=float, default=None, metavar="SECONDS",
      help="HTTP streams send an SSE comment (`: keepalive`) after this long without an event "
      "(off unless given: OpenAI's and vLLM's servers send none, and some clients lose the "
      "events after one)")
    a("--http-timeout", type=float, default=10.0, metavar="SECONDS",
      help="an HTTP connection is closed when it has not sent a whole request's headers this "
      "long after connecting, or sent nothing this long after its last response")
    a("--api-key", default=None, metavar="KEY",
      help="bearer token the HTTP API asks for (needed for a non-loopback --http)")
    a("--api-key-file", default=None, metavar="PATH",
      help="read the API key from PATH (keeps it off the command line)")
    a("--worker-listen", default="tcp://127.0.0.1:5556", metavar="ENDPOINT",
      help="where workers register (remote workers: `siding worker --coordinator` this)")
    a("--worker-wait", type=float, default=60.0, metavar="S",
      help="while the workers are down (restarting, backing off), requests wait up to S "
      "seconds for them, then fail with worker_failed")
    a("--metrics-port", type=int, default=9400, metavar="P",
      help="coordinator metrics port P (worker i: P+1+i); 0 turns the metrics endpoints off")
    a("--write-prometheus-config", metavar="PATH", default=None,
      help="write a Prometheus scrape config for this cluster's metrics ports to PATH")
    a("--curve-keys", default=None, metavar="DIR",
      help="directory of CURVE keys (`siding keys DIR`) for every socket: clients need them "
      "too. `coordinator` needs them (or --insecure) for its worker links, loopback or not; "
      "`launch` makes keys of its own for its workers' links")
    a("--insecure", action="store_true",
      help="allow non-loopback binds without CURVE, and `coordinator` worker links without keys")
    a("--worker-threads", type=int, default=0, metavar="N",
      help="torch CPU threads per local worker (0: the cores this process may use, shared out)")


def config_from_args(args: argparse.Namespace):
    from .config import CoordinatorConfig

    worker = WorkerConfig(**{name: getattr(args, name) for name in WorkerConfig.__struct_fields__})
    return CoordinatorConfig(
        worker=worker, workers=args.workers, devices=args.devices.split(","),
        prefix_cache=args.prefix_cache,
        preempt_every=args.preempt_every,
        prefill_hold_ms=args.prefill_hold_ms, multi_step=args.multi_step,
        max_queued_per_client=args.max_queued_per_client,
        worker_wait=args.worker_wait,
        listen=args.listen, frontends=args.frontends, http=args.http, api_key=_api_key(args),
        sse_keepalive=args.sse_keepalive,
        http_timeout=args.http_timeout,
        worker_listen=args.worker_listen,
        metrics_port=args.metrics_port or None, curve_keys=args.curve_keys,
        insecure=args.insecure, spawn_workers=args.spawn, worker_threads=args.worker_threads,
        log_level=args.log_level,
    )


def _busy_poll(value: str) -> float | None:
    """`--busy-poll`: auto (None) or seconds (their range is WorkerConfig's to check)."""
    if value == "auto":
        return None
    try:
        return float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be auto or seconds, not {value}") from None


def _api_key(args: argparse.Namespace) -> str | None:
    if args.api_key is not None and args.api_key_file is not None:
        raise ValueError("give --api-key or --api-key-file, not both")
    if args.api_key_file is not None:
        from pathlib import Path

        try:
            return Path(args.api_key_file).read_text().strip()
        except OSError as e:
            raise ValueError(f"--api-key-file {args.api_key_file}: cannot read it: "
                             f"{e.strerror}") from None
    return args.api_key


def cmd_launch(args: argparse.Namespace) -> None:
    from .engine import EngineCore

    config = config_from_args(args)
    if config.spawn_workers and config.workers > 1:  # refused here, not by each of N workers
        from worker.loaders import check_split, layer_count

        check_split(config.worker.model, layer_count(config.worker.model), config.workers)
    if args.write_prometheus_config and not config.metrics_port:
        raise ValueError("--write-prometheus-config needs the metrics on (--metrics-port P)")
    stop, now, serving = threading.Event(), threading.Event(), threading.Event()

    def on_signal(*_) -> None:
        if not serving.is_set():  # loading: nothing to drain
            raise KeyboardInterrupt
        if stop.is_set():
            now.set()
            print("siding: stopping now", file=sys.stderr, flush=True)
            return
        stop.set()
        print("siding: draining the running requests (Ctrl-C again to stop now)",
              file=sys.stderr, flush=True)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    engine = EngineCore(config)
    try:
        if config.metrics_port:
            host = _host(config.listen)
            try:
                engine.metrics.serve(config.metrics_port, host)
            except OSError as e:
                raise OSError(f"--metrics-port {config.metrics_port}: cannot listen on "
                              f"{host}:{config.metrics_port}: {e.strerror}") from None
        if args.write_prometheus_config and config.spawn_workers:
            _write_prometheus_config(args.write_prometheus_config, config, None)
        where = "local" if config.spawn_workers else "remote"
        print(f"siding: loading {config.worker.model} on {config.workers} {where} worker(s)...",
              file=sys.stderr, flush=True)
        engine.start()
        if args.write_prometheus_config and not config.spawn_workers:  # now their hosts are known
            hosts = [_host(h.reg.data_endpoint) for h in engine.workers.handles]
            _write_prometheus_config(args.write_prometheus_config, config, hosts)
        if engine.frontends.http_url:
            print(f"http {engine.frontends.http_url}", flush=True)
        print(f"ready {engine.endpoint}", flush=True)
        serving.set()
        engine.serve(should_stop=stop.is_set, hurry=now.is_set)
    finally:
        engine.close()


def _host(endpoint: str) -> str:
    """The host of a tcp:// endpoint (the first of a list); metrics bind where the client
    socket does (loopback by default). Local workers advertise loopback."""
    transport, _, address = endpoint.split(",")[0].partition("://")
    if transport != "tcp":
        return "127.0.0.1"
    host = address.rpartition(":")[0].removeprefix("[").removesuffix("]")
    return "0.0.0.0" if host == "*" else host


def _write_prometheus_config(path: str, config, worker_hosts: list[str] | None) -> None:
    from pathlib import Path

    from . import prometheus_config

    text = prometheus_config.for_cluster(
        config.metrics_port, config.workers,
        coordinator_host=prometheus_config.scrape_host(_host(config.listen)),
        worker_hosts=worker_hosts and [prometheus_config.scrape_host(h) for h in worker_hosts])
    Path(path).write_text(text)
    print(f"siding: wrote a Prometheus config to {path}", file=sys.stderr, flush=True)


def _client(args: argparse.Namespace):
    from protocol import Client

    return Client(args.endpoint, timeout=args.timeout, curve_keys_dir=args.curve_keys)


def _sampling(args: argparse.Namespace) -> dict:
    return {name: getattr(args, name) for name in SamplingParams.__struct_fields__
            if hasattr(args, name)}


def cmd_generate(args: argparse.Namespace) -> None:
    if args.stream and args.n > 1:
        raise ValueError("--stream prints one completion; give -n without --stream")
    prompt = {"prompt": args.prompt}
    if args.system is not None:
        prompt = {"messages": [{"role": "system", "content": args.system},
                               {"role": "user", "content": args.prompt}]}
    with _client(args) as c:
        if args.stream:
            for chunk in c.stream(**prompt, **_sampling(args)):
                print(chunk.text, end="", flush=True)
            print()
            return
        r = c.generate(**prompt, **_sampling(args))
    if args.json:
        print(json.dumps({"request_id": r.request_id, "text": r.text, "token_ids": r.token_ids,
                          "finish_reason": r.finish_reason, "usage": r.usage,
                          "prompt_token_ids": r.prompt_token_ids,
                          "choices": [msgspec.structs.asdict(c) for c in r.choices]}))
    elif args.n == 1:
        print(r.text)
    else:
        for choice in r.choices:
            print(f"[{choice.index}] {choice.text}")


CHAT_HELP = """commands:
  /help           this list
  /reset          forget the conversation (the system prompt stays)
  /system [TEXT]  set the system prompt (none: clear it), and start over
  /exit           leave (Ctrl-D, or Ctrl-C at the prompt, too)
Ctrl-C during a reply stops it; what it said so far stays in the conversation."""


def cmd_chat(args: argparse.Namespace) -> None:
    system = args.system
    messages: list[dict] = []
    with _client(args) as c:
        while True:
            try:
                line = input("> ")
            except (EOFError, KeyboardInterrupt):  # Ctrl-D, or Ctrl-C with no reply to stop
                print()
                return
            if not line.strip():
                continue
            command, _, rest = line.strip().partition(" ")
            if command in ("/exit", "/quit"):
                return
            if command == "/help":
                print(CHAT_HELP)
                continue
            if command == "/reset":
                messages = []
                print("(the conversation starts over)")
                continue
            if command == "/system":
                system, messages = rest.strip() or None, []
                print("(system prompt " + ("set" if system else "cleared") + "; starting over)")
                continue
            if command.startswith("/"):
                print(f"unknown command {command}; /help lists them")
                continue
            head = [{"role": "system", "content": system}] if system else []
            reply = _chat_reply(c, head + messages + [{"role": "user", "content": line}], args)
            if reply:  # an empty one (stopped before it said anything): as if never asked
                messages += [{"role": "user", "content": line},
                             {"role": "assistant", "content": reply}]


def _chat_reply(c, messages: list[dict], args: argparse.Namespace) -> str:
    """Stream a reply to the terminal; Ctrl-C stops it (the request is aborted) and what was
    shown stays the reply."""
    shown = []
    stream = c.chat_stream(messages, **_sampling(args))
    try:
        for chunk in stream:
            print(chunk.text, end="", flush=True)
            shown.append(chunk.text)
        print()
    except KeyboardInterrupt:
        stream.close()
        print("\n(reply stopped)", flush=True)
    return "".join(shown)


def cmd_status(args: argparse.Namespace) -> None:
    with _client(args) as c:
        s = c.status()
    if args.json:
        print(json.dumps(s, indent=2))
        return
    print(status_table(s))


def status_table(s: dict) -> str:
    """`siding status` for people: the figures the Prometheus metrics carry."""
    pool, reqs, lat = s["pool"], s["requests"], s["latency_mean_seconds"]
    cache = s["prefix_cache"]

    def counts(d: dict) -> str:
        return "   ".join(f"{k} {v}" for k, v in d.items() if v) or "none"

    expected, registered = s["workers_expected"], s["workers_registered"]
    workers = f"workers up {s['workers_up']} of {expected}" + (
        f" ({registered} registered, {expected - registered} awaited)"
        if registered < expected else "")
    if s["layers"]["total"]:
        workers += f"   layers up {s['layers']['up']} of {s['layers']['total']}"
    lines = [
        f"model      {s['model']}   exact mode {'on' if s['exact'] else 'off'}   {workers}",
        f"requests   running {reqs['running']}   waiting {reqs['waiting']}   "
        f"parked {reqs['parked']}",
        f"finished   {counts(s['finished'])}",
        f"errors     {counts(s['errors'])}",
        f"kv pool    {pool['pages_used']} / {pool['pages_total']} pages used "
        f"(page size {pool['page_size']})   park store {s['park_pages_used']} pages used",
        f"tokens     prompt {s['tokens']['prompt']}   generated {s['tokens']['generated']}",
        f"preempted  {counts(s['preemptions'])}   restored {s['restores']}",
        f"prefix     {cache['hit_tokens']} of {cache['queried_tokens']} prompt tokens cached   "
        f"{cache['cached_pages']} pages idle   evictions {cache['evictions']}"
        if s["config"]["prefix_cache"] else "prefix     cache off",
        "latency    " + "   ".join(f"{k} {_seconds(v)}" for k, v in lat.items()) + "   (means)",
        "",
        f"{'rank':>4}  {'device':<8} {'layers':<10} {'pid':>8}  {'host':<16} {'state':<6} forward",
    ]
    for w in s["workers"]:
        layers = f"{w['layers'][0]}-{w['layers'][1] - 1}" if w["ready"] else "-"
        state = "down" if not w["alive"] else "up" if w["ready"] else "load"
        lines.append(f"{w['rank']:>4}  {w['device']:<8} {layers:<10} {w['pid']:>8}  "
                     f"{w['host'][:16]:<16} {state:<6} {_seconds(w['forward_seconds_mean'])}")
    return "\n".join(lines)


def _seconds(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x * 1000:.1f} ms" if x < 1 else f"{x:.2f} s"


def cmd_demo(args: argparse.Namespace) -> None:
    from .demo import run_demo

    run_demo(args.model, args.workers)


def cmd_bench(args: argparse.Namespace) -> None:
    # A fresh interpreter runs the scenario, so `coordinator` never imports the benchmarks.
    debug = ["--debug"] if args.debug else []
    os.execv(sys.executable,
             [sys.executable, "-m", "benchmarks", *debug, args.scenario, *args.rest])


def cmd_keys(args: argparse.Namespace) -> None:
    from protocol import security

    security.generate_keys(args.dir)
    print(f"wrote CURVE keys to {args.dir}")
