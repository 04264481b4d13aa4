"""The command line is built from the config dataclasses: every role's defaults are the dataclasses' defaults, and
`pdserve serve` hands every setting, whatever its value, to the processes it starts."""
import dataclasses
import sys
import typing

import pytest

from pdserve_server.cli.args import dataclass_from_args, dataclass_to_argv
from pdserve_server.cli.launcher import ServeConfig
from pdserve_server.cli.main import _PER_PROCESS, SERVE_WORKER_SKIP, build_parser
from pdserve_server.coordinator.config import CoordinatorConfig
from pdserve_server.engine.args import EngineArgs
from pdserve_server.worker_common.config import WorkerConfig

PDSERVE = [sys.executable, "-m", "pdserve_server.cli.main"]  # the `pdserve` command of this interpreter


def test_commands_default_to_the_dataclass_defaults():
    for role in ("prefill", "decode", "colocated"):
        got = dataclass_from_args(WorkerConfig, build_parser(role).parse_args([]), role=role, model_dir="m")
        assert got == WorkerConfig(role=role, engine=EngineArgs(model_dir="m"))
    got = dataclass_from_args(CoordinatorConfig, build_parser("coordinator").parse_args([]), model_dir="m",
                              model_name="n")
    assert got == CoordinatorConfig(model_dir="m", model_name="n")
    assert dataclass_from_args(ServeConfig, build_parser("serve").parse_args([])) == ServeConfig()


def _other_value(f: dataclasses.Field, annotation):
    """A value different from the field's default, of its type."""
    default = f.default
    kind = typing.get_args(annotation)[0] if type(None) in typing.get_args(annotation) else annotation
    if kind is bool:
        return not default
    if typing.get_origin(kind) is tuple:
        return ("a:1", "b:2")
    if "choices" in f.metadata:
        return next(c for c in f.metadata["choices"] if c != default)
    if kind is int:
        return (default or 0) + 3
    if kind is float:
        return (default or 0.0) + 0.5
    return f"x-{f.name}"


def _everything_changed(cls, skip=frozenset(), **values):
    """An instance of cls (nested dataclasses too) with every flag-backed field away from its default."""
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name in values:
            kwargs[f.name] = values[f.name]
        elif dataclasses.is_dataclass(hints[f.name]):
            kwargs[f.name] = _everything_changed(hints[f.name], skip, **values)
        elif f.metadata.get("cli", True) and f.name not in skip:
            kwargs[f.name] = _other_value(f, hints[f.name])
    return cls(**kwargs)


@pytest.mark.parametrize("role", ["prefill", "decode", "colocated"])
def test_serve_forwards_every_worker_setting(role):
    """Any WorkerConfig/EngineArgs field, new ones included, survives serve -> worker argv -> worker parser."""
    want = _everything_changed(WorkerConfig, skip=SERVE_WORKER_SKIP, role=role, model_dir="m")
    serve_ns = build_parser("serve").parse_args(dataclass_to_argv(want, skip=SERVE_WORKER_SKIP))
    from_serve = dataclass_from_args(WorkerConfig, serve_ns, role=role, model_dir="m", port=0)
    assert from_serve == want
    argv = dataclass_to_argv(from_serve, skip=SERVE_WORKER_SKIP)
    assert dataclass_from_args(WorkerConfig, build_parser(role).parse_args(argv), role=role, model_dir="m") == want


def test_serve_forwards_every_coordinator_setting():
    want = _everything_changed(CoordinatorConfig, skip=_PER_PROCESS, model_dir="m", model_name="n")
    serve_ns = build_parser("serve").parse_args(dataclass_to_argv(want, skip=_PER_PROCESS) + ["--port", "0"])
    from_serve = dataclass_from_args(CoordinatorConfig, serve_ns, model_dir="m", model_name="n")
    assert dataclass_to_argv(from_serve, skip=_PER_PROCESS) == dataclass_to_argv(want, skip=_PER_PROCESS)
    argv = dataclass_to_argv(from_serve, skip=_PER_PROCESS - {"port"})
    parsed = dataclass_from_args(CoordinatorConfig, build_parser("coordinator").parse_args(argv), model_dir="m",
                                 model_name="n")
    assert dataclass_to_argv(parsed, skip=_PER_PROCESS) == dataclass_to_argv(want, skip=_PER_PROCESS)


def test_role_flags_round_trip_with_lists():
    config = CoordinatorConfig(model_dir="m", model_name="n", prefill=("p0:1", "p1:2"), decode=("d0:3",),
                               colocated=False, max_in_flight=9)
    parsed = build_parser("coordinator").parse_args(dataclass_to_argv(config))
    assert dataclass_from_args(CoordinatorConfig, parsed, model_dir="m", model_name="n") == config


def test_serve_splits_the_cpus_among_its_workers():
    from pdserve_server.cli.launcher import worker_threads

    assert worker_threads(2, num_cpus=2) == 1  # 1 prefill + 1 decode on two cores: one each
    assert worker_threads(1, num_cpus=2) == 2  # colocated: both cores
    assert worker_threads(1, num_cpus=16) == 16
    assert worker_threads(2, num_cpus=16) == 8
    assert worker_threads(3, num_cpus=8) == 2
    assert worker_threads(4, num_cpus=2) == 1  # never 0


def test_a_gguf_converts_once_per_content_wherever_it_is(tmp_path, monkeypatch, capsys):
    """The conversion cache is keyed by the file's bytes: the same GGUF at another path (a fresh install) with
    another mtime reuses the converted directory; different bytes convert again. Each conversion says so on stderr
    (it takes minutes on a small machine)."""
    import os
    import subprocess

    from pdserve_server.cli import models

    runs = []

    def fake_convert(cmd, **kw):
        runs.append(cmd)
        out = tmp_path / "cache" / cmd[-1].rsplit("/", 1)[-1]
        out.mkdir(parents=True)
        (out / "config.json").write_text("{}")
        return subprocess.CompletedProcess(cmd, 0, "", "")
    monkeypatch.setattr(models.subprocess, "run", fake_convert)
    a, b, c = tmp_path / "a" / "m.gguf", tmp_path / "b" / "m.gguf", tmp_path / "c" / "m.gguf"
    for p, data in ((a, b"GGUF same"), (b, b"GGUF same"), (c, b"GGUF other")):
        p.parent.mkdir()
        p.write_bytes(data)
    os.utime(b, (1, 1))
    cache = tmp_path / "cache"
    first = models.resolve_model(str(a), cache)
    assert models.resolve_model(str(b), cache) == first and len(runs) == 1
    assert models.resolve_model(str(c), cache) != first and len(runs) == 2
    err = capsys.readouterr().err
    assert err.count("converting m.gguf to an HF-format directory, once") == 2 and err.count("converted m.gguf") == 2


def test_a_grpc_server_on_a_busy_port_fails_to_start():
    """grpcio binds with SO_REUSEPORT unless told not to: a second server on a busy port used to start and take
    part of the first one's traffic. Now it is a CommandError that names the port."""
    import asyncio

    import grpc

    from pdserve_server.server_common.config import ServerArgs
    from pdserve_server.server_common.errors import CommandError
    from pdserve_server.server_common.grpc_server import start_grpc_server

    async def main():
        # The first holder as grpcio leaves it by default (SO_REUSEPORT on), as any other gRPC server would.
        other = grpc.aio.server()
        port = other.add_insecure_port("127.0.0.1:0")
        await other.start()
        try:
            with pytest.raises(CommandError, match=f"port {port} is in use"):
                await start_grpc_server(ServerArgs(host="127.0.0.1", port=port), lambda s: None, [], tokens=[])
        finally:
            await other.stop(None)
    asyncio.run(main())


@pytest.mark.e2e
def test_a_worker_on_a_busy_port_exits_with_one_line(tiny_model_dir):
    """The command line reports the busy port in one line (no traceback) and exits non-zero."""
    import socket
    import subprocess
    import sys

    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen(1)
    port = holder.getsockname()[1]
    try:
        done = subprocess.run([*PDSERVE, "decode", "--model", str(tiny_model_dir),
                               "--host", "127.0.0.1", "--port", str(port), "--kv-tokens", "256",
                               "--max-model-len", "128", "--threads", "1", "--log-level", "ERROR"],
                              capture_output=True, text=True, timeout=300)
    finally:
        holder.close()
    assert done.returncode == 1
    assert f"pdserve decode: port {port} is in use" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("command,argv,message", [
    ("decode", ["--max-num-seqs", "-1"], "argument --max-num-seqs: must be >= 1, got -1"),
    ("prefill", ["--kv-tokens", "-5"], "argument --kv-tokens: must be >= 1, got -5"),
    ("coordinator", ["--stats-interval-s", "0"], "argument --stats-interval-s: must be > 0, got 0"),
    ("serve", ["--port", "70000"], "argument --port: must be <= 65535, got 70000"),
    ("serve", ["--max-num-batched-tokens", "x"], "argument --max-num-batched-tokens: invalid int value: 'x'"),
])
def test_out_of_range_settings_are_refused_as_the_flags_are_parsed(command, argv, message, capsys):
    """`--max-num-seqs -1` gave a ready server whose requests hung; `--kv-tokens -5` failed after model loading in
    84 lines of traceback. Now argparse refuses them at once: usage and one line, exit status 2."""
    with pytest.raises(SystemExit) as e:
        build_parser(command).parse_args(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_user_errors_of_the_command_line_are_one_line(tmp_path, tiny_model_dir):
    """A missing model path and a coordinator that is not there used to end in tracebacks; a decode worker asked
    for the nccl connector over tensor-parallel ranks on several GPUs is refused before anything is built."""
    import socket
    import subprocess
    import sys

    def run(*argv):
        return subprocess.run([*PDSERVE, *argv], capture_output=True, text=True, timeout=120)

    missing = run("decode", "--model", str(tmp_path / "nowhere"))
    assert missing.returncode == 1 and "Traceback" not in missing.stderr
    assert f"pdserve decode: model path {tmp_path / 'nowhere'} does not exist (--model)" in missing.stderr

    nccl = run("decode", "--model", str(tiny_model_dir), "--device", "cuda", "--tensor-parallel-size", "2",
               "--connector", "nccl", "--port", "0")
    assert nccl.returncode == 1 and "Traceback" not in nccl.stderr
    assert "--tensor-parallel-size 2 puts a KV shard on each of its GPUs: use --connector ucx or tcp" in nccl.stderr

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    refused = run("generate", "hi", "--address", f"127.0.0.1:{port}", "--timeout", "20")
    assert refused.returncode == 1 and "Traceback" not in refused.stderr
    assert "pdserve generate: UNAVAILABLE: " in refused.stderr and "is a coordinator serving on" in refused.stderr


def test_the_converted_default_model_names_its_architecture(real_model_dir):
    """Other tools build the LM head from config.json's architectures (vLLM loaded the directory without one)."""
    import json

    assert json.loads((real_model_dir / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]


def test_key_id_prints_the_name_logs_and_tenant_weights_use(capsys, monkeypatch):
    import io

    from pdserve_server.cli.main import main
    from pdserve_server.server_common.security import key_id

    main(["key-id", "sk-one", "sk-two"])
    assert capsys.readouterr().out.split() == [f"key:{key_id('sk-one')}", f"key:{key_id('sk-two')}"]
    monkeypatch.setattr("sys.stdin", io.StringIO("# keys\nsk-one\n\n"))  # keys stay out of the process list
    main(["key-id"])
    assert capsys.readouterr().out.split() == [f"key:{key_id('sk-one')}"]


def test_serve_restart_backs_off_a_process_that_keeps_dying_at_start(monkeypatch, capsys):
    """`Cluster.supervise(restart=True)` on a worker that dies as soon as it starts (a taken port, a missing
    model): the waits between its starts double (1, 2, 4, 8 s, at most RESTART_BACKOFF_MAX_S), on a fake clock."""
    from pdserve_server.cli import launcher

    class Dead:
        returncode = 1

        def poll(self):
            return 1

    clock = [0.0]

    def monotonic() -> float:
        clock[0] += 0.25  # each look at the clock is a quarter second later
        return clock[0]

    starts: list[float] = []
    cluster = launcher.Cluster("127.0.0.1:1", processes={"decode-0": Dead()}, workdir="/nonexistent",
                               worker_addresses={"decode-0": "127.0.0.1:2"}, _commands={"decode-0": ["decode"]})

    def spawn(args, name, workdir, log_dir, env):
        starts.append(clock[0])
        assert args[-2:] == ["--port", "2"]  # on its old port
        if len(starts) == 6:
            cluster._stopping.set()
        return Dead(), None, ""

    monkeypatch.setattr(launcher.time, "monotonic", monotonic)
    monkeypatch.setattr(launcher, "_spawn", spawn)
    cluster.supervise(restart=True, poll_s=0)
    waits = [b - a for a, b in zip(starts, starts[1:])]
    assert [round(w) for w in waits] == [2, 4, 8, 16, 30]  # after the first (1 s): doubling, capped
    assert capsys.readouterr().out.count("exited with code 1") == 6


def test_ctrl_c_of_a_command_is_one_line_and_status_130(monkeypatch, capsys):
    """Ctrl-C of `pdserve generate` printed a 25-line KeyboardInterrupt traceback."""
    from pdserve_server.cli import main as cli_main

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli_main, "_stream", interrupted)
    with pytest.raises(SystemExit) as e:
        cli_main.main(["generate", "hello"])
    assert e.value.code == 130
    assert capsys.readouterr().err.strip().splitlines() == ["pdserve generate: interrupted"]


def test_generate_help_gives_each_flag_and_its_default():
    text = build_parser("generate").format_help()
    for needle in ("the coordinator's host:port", "(default: 127.0.0.1:50051)", "most tokens to generate (default: 64)",
                   "sampling temperature (0 = greedy) (default: 0.0)"):
        assert needle in " ".join(text.split()), needle


@pytest.mark.parametrize("command", ["serve", "coordinator", "decode", "generate"])
def test_log_level_defaults_to_info_and_says_so(command):
    """serve defaulted to WARNING, which hid the access log lines docs/observability.md promises."""
    parser = build_parser(command)
    assert parser.parse_args(["p"] if command == "generate" else []).log_level == "INFO"
    assert "(default: INFO)" in " ".join(parser.format_help().split())
    assert parser.parse_args((["p"] if command == "generate" else []) + ["--log-level", "debug"]).log_level == "DEBUG"


def test_serve_checks_its_port_and_the_model_before_it_spawns_anything(tmp_path, tiny_model_dir):
    """A busy port and an unsupported architecture or RoPE type were reported only after every worker had loaded
    (47-77 s), once per worker. Now `serve` says so in one line before it starts anything."""
    import json
    import shutil
    import socket
    import subprocess
    import sys

    def serve(*argv):
        return subprocess.run([*PDSERVE, "serve", "--kv-tokens", "256", "--threads", "1",
                               *argv], capture_output=True, text=True, timeout=120)

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen(1)
        port = holder.getsockname()[1]
        busy = serve("--model", str(tiny_model_dir), "--port", str(port))
    assert busy.returncode == 1 and "Traceback" not in busy.stderr
    assert f"pdserve serve: port {port} is in use" in busy.stderr and "starting pdserve" not in busy.stdout

    for field, value, needle in (("model_type", "gpt2", "unsupported model_type 'gpt2'"),
                                 ("rope_scaling", {"rope_type": "yarn", "factor": 4.0}, "rope_type 'yarn'")):
        model = tmp_path / field
        shutil.copytree(tiny_model_dir, model)
        config = json.loads((model / "config.json").read_text())
        config[field] = value
        (model / "config.json").write_text(json.dumps(config))
        bad = serve("--model", str(model), "--port", "0")
        assert bad.returncode == 1 and "Traceback" not in bad.stderr, bad.stderr
        assert needle in bad.stderr and len(bad.stderr.strip().splitlines()) == 1, bad.stderr
        assert "starting pdserve" not in bad.stdout


def test_starting_a_cluster_says_each_process_ready_and_what_is_still_starting(tmp_path, monkeypatch):
    """`serve` is not silent while its workers load: each process is reported as it gets ready (k of N), and what is
    still starting every WAIT_NOTE_S; a process that exits first is an error naming it."""
    import subprocess
    import sys

    from pdserve_server.cli import launcher
    from pdserve_server.server_common.errors import CommandError

    monkeypatch.setattr(launcher, "WAIT_NOTE_S", 0.0)  # a note at every poll
    procs = [(name, subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]), tmp_path / name)
             for name in ("decode-0", "decode-1")]
    lines: list[str] = []

    def progress(line: str) -> None:
        lines.append(line)
        if "still starting" in line:  # one note while both wait, then they get ready one by one
            for name, _, ready in procs:
                if not ready.exists():
                    ready.write_text(f'{{"address": "{name}"}}')
                    break
    try:
        infos = launcher.wait_ready(procs, 60, progress, (0, 3))
        assert [i["address"] for i in infos] == ["decode-0", "decode-1"]
        assert "  decode-0 ready (1/3)" in lines and "  decode-1 ready (2/3)" in lines
        assert any("still starting" in line and "decode-0, decode-1" in line for line in lines)
        dead = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
        dead.wait()
        with pytest.raises(CommandError, match="coordinator exited with code 3 before it was ready"):
            launcher.wait_ready([("coordinator", dead, tmp_path / "never")], 60, progress)
    finally:
        for _, proc, _ in procs:
            proc.kill()
            proc.wait()


def test_the_configuration_reference_is_current():
    """docs/configuration.md is every command's --help, generated (`python -m pdserve_server.cli.reference`): a flag,
    default or help text changed without regenerating it fails here. argparse lays help out differently across Python versions,
    so the comparison runs under the version the file names."""
    import re
    from pathlib import Path

    from pdserve_server.cli.reference import configuration_reference, python_version

    text = (Path(__file__).resolve().parents[2] / "docs" / "configuration.md").read_text()
    made_with = re.search(r"under Python (\d+\.\d+)", text).group(1)
    if made_with != python_version():
        pytest.skip(f"docs/configuration.md was generated under Python {made_with}, this is {python_version()}")
    assert text == configuration_reference(), \
        "regenerate: .venv/bin/python -m pdserve_server.cli.reference > docs/configuration.md"
