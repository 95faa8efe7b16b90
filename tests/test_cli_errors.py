"""Bad flags of `hetero-jax bench`, `generate`, `sim` (and `batch --tensor-parallel`) end in
argparse errors (exit status 2, one line naming the flag, the value and the limit) before any
work: no engine, no simulation, no jax import where none is needed. Nothing here runs an
engine or a simulation: the entry points that would do the work are replaced by ones that
fail the test."""
import argparse
import os
import subprocess
import sys

import pytest

from hetero_jax import cli
from hetero_jax.bench import cli as bench_cli
from hetero_jax.offline import cli as batch_cli
from hetero_jax.sim import cli as sim_cli


def no_work(*args, **kwargs):
    raise AssertionError("the work started before the flags were checked")


@pytest.fixture
def no_engines(monkeypatch):
    monkeypatch.setattr(bench_cli, "run_bench", no_work)
    monkeypatch.setattr(cli, "cmd_generate", no_work)
    monkeypatch.setattr(sim_cli, "simulate", no_work)


@pytest.fixture
def a_file(tmp_path):
    """A regular file: nothing can be created under it, as root too."""
    path = tmp_path / "a_file"
    path.write_text("x")
    return path


def error_line(e, capsys) -> str:
    """The exit status must be 2 and stderr end in one `error:` line; returns that line."""
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err and "error: " in err[-1], err
    return err[-1]


def output_cases(tmp_path, a_file) -> list:
    """(flags, the flag named, the path named, what is wrong)"""
    return [
        (["--json", f"{a_file}/out.json"], "--json", f"{a_file}/out.json", "is not a directory"),
        (["--json", f"{a_file}/sub/dir/out.json"], "--json", f"{a_file}/sub/dir/out.json",
         "is not a directory"),
        (["--json", str(tmp_path)], "--json", str(tmp_path), "it is a directory"),
        (["--plot", f"{a_file}/out.png"], "--plot", f"{a_file}/out.png", "is not a directory"),
        (["--plot", str(tmp_path)], "--plot", str(tmp_path), "it is a directory"),
        (["--compile-cache", f"{a_file}/xla"], "--compile-cache", f"{a_file}/xla",
         "is not a directory"),
        (["--compile-cache", str(a_file)], "--compile-cache", str(a_file),
         "it is not a directory"),
    ]


def test_bench_output_paths_are_checked_before_any_engine(tmp_path, a_file, no_engines,
                                                         capsys):
    for flags, flag, path, why in output_cases(tmp_path, a_file):
        with pytest.raises(SystemExit) as e:
            cli.main(["bench", "--preset", "tiny", *flags])
        line = error_line(e, capsys)
        assert f"argument {flag}: cannot write {path!r}" in line and why in line, (flags, line)
    assert sorted(os.listdir(tmp_path)) == ["a_file"]


def test_bench_output_check_leaves_nothing_behind_and_accepts_what_can_be_written(tmp_path):
    existing = tmp_path / "old.json"
    existing.write_text("{}")
    before = sorted(os.listdir(tmp_path))
    cfg = bench_cli.parse_config(["--preset", "tiny", "--json", str(tmp_path / "new/sub/b.json"),
                                  "--plot", str(existing), "--compile-cache",
                                  str(tmp_path / "cache/xla")])
    assert (cfg.json, cfg.plot) == (str(tmp_path / "new/sub/b.json"), str(existing))
    assert sorted(os.listdir(tmp_path)) == before and existing.read_text() == "{}"
    assert bench_cli.parse_config(["--preset", "tiny", "--compile-cache", "none"]).compile_cache \
        is None
    assert bench_cli.parse_config(["--preset", "tiny"]).engine_config().compile_cache == "auto"


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="no /proc")
def test_bench_location_no_one_can_write_is_an_error(no_engines, capsys):
    """Nothing can be created in /proc, as root too: a read-only location."""
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "--preset", "tiny", "--plot", "/proc/hetero-jax/b.png"])
    assert "argument --plot: cannot write '/proc/hetero-jax/b.png': '/proc' is not writable" in \
        error_line(e, capsys)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through permission bits")
def test_bench_read_only_directory_is_an_error(tmp_path, no_engines, capsys):
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o500)
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "--preset", "tiny", "--json", str(ro / "b.json")])
    assert f"argument --json: cannot write '{ro}/b.json': '{ro}' is not writable" in \
        error_line(e, capsys)


def test_generate_json_path_is_checked_before_any_engine(tmp_path, a_file, no_engines, capsys):
    for target, why in [(f"{a_file}/g.json", "is not a directory"),
                        (str(tmp_path), "it is a directory")]:
        with pytest.raises(SystemExit) as e:
            cli.main(["generate", "--preset", "tiny", "--json", target])
        line = error_line(e, capsys)
        assert f"argument --json: cannot write {target!r}" in line and why in line, line
    assert sorted(os.listdir(tmp_path)) == ["a_file"]


def generate_parser() -> argparse.ArgumentParser:
    (sub,) = [a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return sub.choices["generate"]


def test_every_generate_flag_has_help_text():
    actions = [a for a in generate_parser()._actions if not isinstance(a, argparse._HelpAction)]
    assert actions and all(a.help for a in actions), [a.dest for a in actions if not a.help]


def test_generate_unknown_preset_fails_before_jax_is_imported():
    code = ("import sys\nfrom hetero_jax.cli import main\ntry:\n"
            "    status = main(['generate', '--preset', 'huge'])\n"
            "except SystemExit as e:\n    status = e.code\n"
            "print(status, 'jax' in sys.modules)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.stdout.split() == ["2", "False"], (proc.stdout, proc.stderr[-2000:])
    assert "argument --preset: invalid choice: 'huge'" in proc.stderr


@pytest.mark.parametrize("flags, message", [
    (["--temperature", "-0.5"], "argument --temperature: -0.5 is outside [0, inf)"),
    (["--temperature", "nan"], "argument --temperature: nan is outside [0, inf)"),
    (["--top-p", "0"], "argument --top-p: 0.0 is outside (0, 1]"),
    (["--top-p", "1.5"], "argument --top-p: 1.5 is outside (0, 1]"),
    (["--top-p", "x"], "argument --top-p: 'x' is not a number"),
    (["--dtype", "float16"], "argument --dtype: invalid choice: 'float16'"),
    (["--seed", "-1"], "argument --seed: -1 is outside [0, 4294967295]"),
    (["--num-prompts", "0"], "argument --num-prompts: 0 is outside [1, "),
    (["--max-num-seqs", "many"], "argument --max-num-seqs: 'many' is not an integer"),
    (["--model", "/no/such/dir"], "argument --model: '/no/such/dir' is not a directory"),
])
def test_generate_bad_flags_are_argparse_errors(flags, message, no_engines, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["generate", "--preset", "tiny", *flags])
    assert message in error_line(e, capsys)


@pytest.mark.parametrize("flags, message", [
    (["--budget", "0"], "argument --budget: 0 is outside [1, "),
    (["--chunk", "0"], "argument --chunk: 0 is outside [1, "),
    (["--page-size", "0"], "argument --page-size: 0 is outside [1, "),
    (["--num-pages", "1"], "argument --num-pages: 1 is outside [2, "),
    (["--max-num-seqs", "0"], "argument --max-num-seqs: 0 is outside [1, "),
    (["--max-chunk-seqs", "0"], "argument --max-chunk-seqs: 0 is outside [1, "),
    (["--replicas", "0"], "argument --replicas: 0 is outside [1, "),
    (["--embed-replicas", "-1"], "argument --embed-replicas: -1 is outside [1, "),
    (["--requests", "0"], "argument --requests: 0 is outside [1, "),
    (["--rate", "0"], "argument --rate: 0.0 is outside (0, inf)"),
    (["--clients", "0"], "argument --clients: 0 is outside [1, "),
    (["--embed-frac", "1.5"], "argument --embed-frac: 1.5 is outside [0, 1]"),
    (["--gen-output", "-5"], "argument --gen-output: bad length spec '-5'"),
    (["--embed-len", "0"], "argument --embed-len: bad length spec '0'"),
    (["--gen-prompt", "96:0,224:0"], "argument --gen-prompt: bad length spec '96:0,224:0'"),
    (["--max-model-len", "10"], "a generation request of up to 128 + 256 = 384 tokens does not "
     "fit --max-model-len 10"),
    (["--gen-prompt", "5000"], "a generation request of up to 5000 + 256 = 5256 tokens does not "
     "fit --max-model-len 4096"),
    (["--embed-len", "100-5000"], "an embedding of up to 5000 tokens does not fit "
     "--max-model-len 4096"),
    (["--num-pages", "20"], "a generation request of up to 384 tokens needs 24 KV pages of 16 "
     "tokens; --num-pages 20 holds 19 (page 0 is scratch)"),
    (["--policy", "ibs,vllm"], "argument --policy: unknown policy 'vllm'"),
    (["--policy", "dedicated"], "dedicated needs --replicas >= 2 and 0 < --embed-replicas < "
     "--replicas"),
    (["--policy", "dedicated", "--replicas", "2", "--embed-replicas", "2"],
     "got --replicas 2, --embed-replicas 2"),
    (["--cost", "roofline:tpu"], "argument --cost: unknown hardware 'tpu'"),
    (["--cost", "/no/such/cost.json"], "argument --cost: "),
])
def test_sim_bad_flags_are_argparse_errors_before_any_simulation(flags, message, no_engines,
                                                                  capsys):
    with pytest.raises(SystemExit) as e:
        sim_cli.sim_main(["--requests", "20", *flags] if "--requests" not in flags else flags)
    line = error_line(e, capsys)
    assert line.startswith("hetero-jax sim: error: ") and message in line, line


def test_sim_requests_that_fit_or_never_occur_are_not_errors(no_engines):
    """Embeddings longer than --max-model-len are fine when there are none (--embed-frac 0),
    and so are generations with --embed-frac 1; the check then reaches the simulation."""
    for flags in (["--embed-frac", "0", "--embed-len", "9000"],
                  ["--embed-frac", "1", "--gen-prompt", "9000"],
                  ["--max-model-len", "384", "--embed-len", "200", "--num-pages", "25"]):
        with pytest.raises(AssertionError, match="the work started"):
            sim_cli.sim_main(["--requests", "20", *flags])


def test_sim_json_path_is_checked_before_the_simulation(a_file, no_engines, capsys):
    with pytest.raises(SystemExit) as e:
        sim_cli.sim_main(["--requests", "20", "--json", f"{a_file}/s.json"])
    assert f"argument --json: cannot write '{a_file}/s.json'" in error_line(e, capsys)


def test_sim_cli_imports_no_jax():
    code = ("import sys\nfrom hetero_jax.cli import main\ntry:\n"
            "    main(['sim', '--budget', '0'])\nexcept SystemExit as e:\n"
            "    print(e.code, 'jax' in sys.modules)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.stdout.split() == ["2", "False"], (proc.stdout, proc.stderr[-2000:])


# -- --tensor-parallel (batch and bench): this process sees one host device -------------------

@pytest.fixture
def batch_input(tmp_path, monkeypatch):
    """A good batch input, and the batch job's engine replaced by one that fails the test."""
    monkeypatch.setattr(batch_cli, "make_front", no_work)
    path = tmp_path / "in.jsonl"
    path.write_text('{"id": 1, "embed": "x"}\n')
    return str(path)


def batch_tp_cases(tmp_path) -> list:
    """(flags, what the error line says)"""
    return [
        (["--tensor-parallel", "0"], "argument --tensor-parallel: 0 is outside [1, "),
        (["--tensor-parallel", "two"], "argument --tensor-parallel: 'two' is not an integer"),
        (["--tensor-parallel", "3"],  # the default mini preset: 4 heads; named before the devices
         "argument --tensor-parallel: tensor_parallel=3 does not divide num_heads=4"),
        (["--tensor-parallel", "2"],
         "argument --tensor-parallel: --tensor-parallel 2 needs 2 devices; jax sees 1 cpu "
         "device(s)"),
    ]


def test_batch_tensor_parallel_errors_name_the_value_and_the_devices(tmp_path, batch_input,
                                                                     capsys):
    out = str(tmp_path / "out.jsonl")
    for flags, message in batch_tp_cases(tmp_path):
        with pytest.raises(SystemExit) as e:
            cli.main(["batch", batch_input, "--output", out, *flags])
        line = error_line(e, capsys)
        assert line.startswith("hetero-jax batch: error: ") and message in line, (flags, line)
    assert not os.path.exists(out)


def test_batch_tensor_parallel_with_replicas_needs_devices_for_each(tmp_path, batch_input,
                                                                   monkeypatch, capsys):
    import jax

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})  # cores suffice
    argv = ["batch", batch_input, "--output", str(tmp_path / "out.jsonl"), "--replicas", "2",
            "--tensor-parallel", "2"]
    monkeypatch.setattr(jax, "devices", lambda: ["d0", "d1", "d2"])
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert "argument --tensor-parallel: --tensor-parallel 2 with --replicas 2 needs 4 devices " \
           "(2 per replica); jax sees 3 cpu device(s)" in error_line(e, capsys)
    monkeypatch.setattr(jax, "devices", lambda: ["d0", "d1", "d2", "d3"])
    with pytest.raises(AssertionError, match="the work started"):  # the checks pass
        cli.main(argv)


def test_batch_replicas_count_gpus_without_jax(tmp_path, batch_input, monkeypatch, capsys):
    """On a GPU host the parent counts the GPUs from CUDA_VISIBLE_DEVICES, never through jax
    (which would take the GPUs' memory before the replica processes start)."""
    import jax

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2")
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    monkeypatch.setattr(jax, "devices", no_work)
    argv = ["batch", batch_input, "--output", str(tmp_path / "out.jsonl"), "--replicas", "2",
            "--tensor-parallel", "2"]
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert "needs 4 devices (2 per replica); this host has 3 GPU(s) (0,1,2)" in \
        error_line(e, capsys)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    with pytest.raises(AssertionError, match="the work started"):  # the checks pass
        cli.main(argv)


@pytest.mark.parametrize("ray_flag", ["--ray", "--ray-data"])
def test_batch_tensor_parallel_on_ray_checks_the_model_not_this_hosts_devices(
        tmp_path, batch_input, monkeypatch, capsys, ray_flag):
    """The actors get their devices from the cluster: TP=2 with one local device passes the
    checks (the work starts), TP=3 on the tiny preset's heads does not."""
    find_spec = batch_cli.importlib.util.find_spec
    monkeypatch.setattr(batch_cli.importlib.util, "find_spec",
                        lambda name: object() if name in ("ray", "pyarrow", "pandas")
                        else find_spec(name))
    argv = ["batch", batch_input, "--output", str(tmp_path / "o"), ray_flag, "--preset", "tiny",
            "--tensor-parallel"]
    with pytest.raises(AssertionError, match="the work started"):
        cli.main(argv + ["2"])
    with pytest.raises(SystemExit) as e:
        cli.main(argv + ["3"])
    assert "argument --tensor-parallel: tensor_parallel=3 does not divide num_heads" in \
        error_line(e, capsys)


@pytest.mark.parametrize("flags, message", [
    (["--tensor-parallel", "0"], "argument --tensor-parallel: 0 is outside [1, "),
    (["--tensor-parallel", "2"], "argument --tensor-parallel: --tensor-parallel 2 with the "
     "dedicated contender is not built"),
    (["--tensor-parallel", "3", "--schedulers", "ibs"],
     "argument --tensor-parallel: tensor_parallel=3 does not divide num_heads=8"),
    (["--tensor-parallel", "2", "--schedulers", "ibs"],
     "argument --tensor-parallel: tensor_parallel=2 exceeds the 1 cpu device(s) jax sees"),
])
def test_bench_tensor_parallel_errors_name_the_value(flags, message, no_engines, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "--preset", "tiny", *flags])
    assert message in error_line(e, capsys)


def test_bench_tensor_parallel_reaches_every_contender_config(monkeypatch):
    import jax

    monkeypatch.setattr(jax, "devices", lambda: ["d0", "d1"])
    cfg = bench_cli.parse_config(["--preset", "tiny", "--schedulers", "ibs,fcfs",
                                  "--tensor-parallel", "2"])
    assert cfg.engine_config().tensor_parallel == 2
    assert bench_cli.parse_config(["--preset", "tiny"]).engine_config().tensor_parallel == 1


def test_batch_ray_data_without_ray_names_the_flag(tmp_path, batch_input, monkeypatch, capsys):
    find_spec = batch_cli.importlib.util.find_spec
    monkeypatch.setattr(batch_cli.importlib.util, "find_spec",
                        lambda name: None if name == "ray" else find_spec(name))
    with pytest.raises(SystemExit) as e:
        cli.main(["batch", batch_input, "--output", str(tmp_path / "o"), "--ray-data"])
    line = error_line(e, capsys)  # pyarrow and pandas may be missing too
    assert "argument --ray-data: needs ray with Ray Data, and ray" in line
    assert "not installed (pip install 'hetero-jax[ray]')" in line


def test_an_unreachable_ray_address_is_named_at_once():
    import socket

    from hetero_jax.serving.ray_replicas import probe_address

    with socket.socket() as s:  # a port that was free a moment ago: refused
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(ValueError, match=rf"cannot reach the Ray cluster at '127.0.0.1:{port}'"):
        probe_address(f"127.0.0.1:{port}")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        probe_address(f"ray://127.0.0.1:{s.getsockname()[1]}")  # listening: passes
    probe_address("auto")  # left to ray.init
