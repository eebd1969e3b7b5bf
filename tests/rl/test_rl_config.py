"""Config: YAML + key=value overrides, bad keys and values rejected naming the key, the resolved config saved."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import yaml
from raises import raises_kind

from stateshift.cli import main
from stateshift.errors import ConfigError
from stateshift.train.config import TrainConfig, field_docs, resolve


def test_unknown_key_fails_naming_it(capsys):
    with raises_kind(ConfigError, "config") as info:
        resolve(None, ["trainer.learning_rate=1e-3"])
    assert info.value.key == "trainer.learning_rate"
    assert main(["train", "rollout.nn=8"]) == 2
    assert "'rollout.nn': unknown key" in capsys.readouterr().err


@pytest.mark.parametrize(
    "override, key",
    [
        ("trainer.lr=-1", "trainer.lr"),
        ("trainer.lr=fast", "trainer.lr"),
        ("rollout.n=1", "rollout.n"),
        ("rollout.n=2.5", "rollout.n"),
        ("trainer.old_logprob=recompute", "trainer.old_logprob"),
        ("trainer.param_offload=maybe", "trainer.param_offload"),
        ("async_training.staleness_threshold=-0.1", "async_training.staleness_threshold"),
        ("run.checkpoint_every=3", "run.checkpoint_every"),
        ("model.heads=3", "model.width"),
        ("nosection.x=1", "nosection"),
        ("trainer=1", "trainer"),
        ("run.seed=99999999999999999999999", "run.seed"),
        ("run.seed=-1", "run.seed"),
        ("run.torch_threads=100000", "run.torch_threads"),
    ],
)
def test_bad_values_name_the_key(override, key):
    with raises_kind(ConfigError, "config") as info:
        resolve(None, [override])
    assert info.value.key == key, str(info.value)


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["trainer.weight_level=sequence"], "trainer.weight_level"),  # the old ambiguous name: product or geomean?
        (["task.name=longtail"], "rollout.max_new_tokens"),  # 5 tokens cannot hold 7 per term
        (["task.name=longtail", "rollout.max_new_tokens=448", "model.family=fsdp2"], "task.name"),
        (["task.name=longtail", "rollout.max_new_tokens=448", "run.checkpoint_every=4"], "run.checkpoint_every"),
        (["rollout.batching=continuous", "run.checkpoint_every=4"], "rollout.batching"),
        (["rollout.batching=continuous", "executor=ray"], "rollout.batching"),
        (["async_training.mode=sync", "async_training.max_queue_size=100"], "async_training.max_queue_size"),
        (["trainer.lr_min_ratio=2"], "trainer.lr_min_ratio"),
        (["task.warmup_max_terms=100"], "task.warmup_max_terms"),
    ],
)
def test_bad_combinations_name_the_key(overrides, key):
    with raises_kind(ConfigError, "config") as info:
        resolve(None, overrides)
    assert info.value.key == key, str(info.value)


def test_yaml_then_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("trainer:\n  lr: 0.002\n  old_logprob: proximal\nrollout:\n  n: 4\n")
    cfg = resolve(path, ["trainer.lr=1e-3", "rollout.n=8", "async_training.max_lag=null"])
    assert (cfg.trainer.lr, cfg.trainer.old_logprob, cfg.rollout.n, cfg.async_training.max_lag) == (
        1e-3,
        "proximal",
        8,
        None,
    )
    path.write_text("trainer:\n  lrr: 1\n")
    with raises_kind(ConfigError, "config", match="trainer.lrr"):
        resolve(path)


def test_resolved_config_is_saved_and_round_trips(tmp_path, capsys):
    assert main(["train", "--print-config", "trainer.lr=3e-4", f"run.out_dir={tmp_path}"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["trainer"]["lr"] == 3e-4
    from rl.rlkit import tiny

    from stateshift.train.launch import run

    cfg = tiny(tmp_path, "trainer.steps=1")
    run(cfg)
    saved = resolve(tmp_path / "run" / "config.yaml")
    assert saved == cfg


def test_every_field_is_documented_and_in_help():
    docs = field_docs()
    assert len(docs) > 40 and all(doc for _, _, doc in docs)
    out = subprocess.run([sys.executable, "-m", "stateshift.cli", "train", "--help"], capture_output=True, text=True)
    assert out.returncode == 0
    for key, _, _ in docs:
        assert key in out.stdout
    assert TrainConfig().trainer.old_logprob == "pi_old" and TrainConfig().trainer.param_offload


def test_outputs_of_a_run(tmp_path):
    """Plain progress lines when the stream is not a terminal; JSONL per step; summary; curves PNG."""
    import io
    import json

    from rl.rlkit import tiny

    from stateshift.train.launch import run

    stream = io.StringIO()
    result = run(
        tiny(tmp_path, "trainer.steps=4", "run.progress=auto", "run.plot=true", "run.eval_every=2"), stream=stream
    )
    text = stream.getvalue()
    assert "\r" not in text and "step 4/4" in text and "held-out accuracy after warm-up" in text
    warm = [line for line in text.splitlines() if line.startswith("warm-up step ")]
    assert warm and warm[-1].startswith("warm-up step 20/20 loss")  # (tiny: 20 warm-up steps)
    records = [json.loads(line) for line in (result.out_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4] and "heldout_accuracy" in records[1]
    for key in (
        "reward",
        "accuracy",
        "entropy",
        "clip_fraction",
        "staleness_tokens",
        "behaviour_weight_max",
        "ess",
        "queue_depth",
        "time_update_s_total",
        "offload_bytes_total",
        "pi_old_bytes_total",
    ):
        assert key in records[-1], key
    assert (result.out_dir / "curves.png").stat().st_size > 10_000
    summary = json.loads((result.out_dir / "summary.json").read_text())
    assert summary["heldout_accuracy_end"] == result.heldout_accuracy_end


def test_resume_arguments_are_checked(tmp_path, capsys):
    assert main(["train", "--resume", str(tmp_path)]) == 2
    assert "no config.yaml" in capsys.readouterr().err
    (tmp_path / "config.yaml").write_text("trainer:\n  steps: 1\n")
    assert main(["train", "--resume", str(tmp_path), "--config", str(tmp_path / "config.yaml")]) == 2
    assert main(["train", "--resume", str(tmp_path), "run.progress=none"]) == 2  # no checkpoint there
    err = capsys.readouterr().err
    assert "no stateshift checkpoint" in err and "run.checkpoint_every" in err


def test_executor_ray_without_ray_says_how_to_install_it(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)  # as if not installed: the import system finds no ray
    with raises_kind(ConfigError, "config", match=r"pip install 'stateshift\[ray\]'") as info:
        resolve(None, ["executor=ray"])
    assert info.value.key == "executor"
    assert main(["train", "executor=ray", "trainer.steps=1"]) == 2
    assert "stateshift[ray]" in capsys.readouterr().err
    with raises_kind(ConfigError, "config", match="must be one of \\['auto', 'inprocess', 'process', 'ray'\\]"):
        resolve(None, ["executor=dask"])


@pytest.mark.parametrize("override", ["run.device=cuda", "model.family=megatron", "model.family=fsdp2"])
def test_executor_ray_takes_every_family_and_the_gpu(override, monkeypatch):
    """Under Ray each actor computes where run.device says (a GPU of its bundle), for every family."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # run.device=cuda passes its own check here
    assert resolve(None, ["executor=ray", override]).executor == "ray"


@pytest.mark.parametrize(
    "override, key",
    [
        ("trainer.lr=.inf", "trainer.lr"),
        ("trainer.lr=inf", "trainer.lr"),
        ("trainer.lr=nan", "trainer.lr"),
        ("trainer.grad_clip=.nan", "trainer.grad_clip"),
        ("trainer.kl_coef=.inf", "trainer.kl_coef"),
        ("rollout.temperature=-.inf", "rollout.temperature"),
        ("run.watchdog_s=.inf", "run.watchdog_s"),
        ("run.max_wall_s=.inf", "run.max_wall_s"),
        ("ray.trainer_cpus=inf", "ray.trainer_cpus"),
        ("trainer.lr=" + "9" * 400, "trainer.lr"),
    ],
)
def test_non_finite_numbers_are_refused_naming_the_key(override, key, tmp_path):
    with raises_kind(ConfigError, "config") as info:
        resolve(None, [override])
    assert info.value.key == key, str(info.value)
    section, name = key.split(".")
    path = tmp_path / "c.yaml"
    path.write_text(f"{section}:\n  {name}: {override.partition('=')[2]}\n")
    with raises_kind(ConfigError, "config") as info:
        resolve(path)
    assert info.value.key == key


BOMB = """\
trainer:
  steps:
    - &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]
    - &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]
    - &c [*b, *b, *b, *b, *b, *b, *b, *b, *b]
    - &d [*c, *c, *c, *c, *c, *c, *c, *c, *c]
    - &e [*d, *d, *d, *d, *d, *d, *d, *d, *d]
    - &f [*e, *e, *e, *e, *e, *e, *e, *e, *e]
    - &g [*f, *f, *f, *f, *f, *f, *f, *f, *f]
    - &h [*g, *g, *g, *g, *g, *g, *g, *g, *g]
    - [*h, *h, *h, *h, *h, *h, *h, *h, *h]
"""

# Resolves a config file in a process whose address space is capped, and reports what happened.
BOUNDED = r"""
import resource, sys, time
resource.setrlimit(resource.RLIMIT_AS, (int(sys.argv[2]), int(sys.argv[2])))
from stateshift.train.config import resolve
from stateshift.errors import ConfigError
t0 = time.perf_counter()
try:
    resolve(sys.argv[1])
except ConfigError as e:
    print("ConfigError", e.key, len(str(e)), round(time.perf_counter() - t0, 2))
"""


def test_yaml_bomb_under_a_known_key_is_refused_quickly_in_bounded_memory(tmp_path):
    path = tmp_path / "bomb.yaml"
    limit = 4 * 2**30  # far below what formatting the expanded bomb takes (tens of GB)
    path.write_text(BOMB)
    out = subprocess.run(
        [sys.executable, "-c", BOUNDED, str(path), str(limit)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0 and out.stdout.startswith("ConfigError"), out.stderr[-2000:]
    _, _, length, seconds = out.stdout.split()
    assert int(length) < 400 and float(seconds) < 5


def test_error_messages_are_formatted_from_bounded_reprs(tmp_path):
    path = tmp_path / "big.yaml"
    path.write_text("trainer:\n  steps: [" + ", ".join(["12345678"] * 100_000) + "]\n")
    with raises_kind(ConfigError, "config") as info:
        resolve(path)
    assert info.value.key == "trainer.steps" and len(str(info.value)) < 400
    path.write_text("trainer:\n  lr: " + "[" * 20_000 + "]" * 20_000 + "\n")
    with raises_kind(ConfigError, "config") as info:
        resolve(path)
    assert len(str(info.value)) < 400
    with raises_kind(ConfigError, "config") as info:
        resolve(None, ["trainer." + "k" * 100_000 + "=1"])
    assert len(str(info.value)) < 600  # the bounded key, and the section's known keys (bounded by the schema)
    with raises_kind(ConfigError, "config") as info:
        resolve(None, ["trainer.old_logprob=" + "x" * 100_000])
    assert len(str(info.value)) < 400


def test_executor_auto_is_the_thread_executor_on_the_cpu_and_rollout_device_is_checked():
    assert resolve(None, []).executor == "inprocess"
    assert resolve(None, ["executor=process"]).executor == "process"
    with raises_kind(ConfigError, "config", match="executor=process only") as info:
        resolve(None, ["rollout.device=cuda:1"])
    assert info.value.key == "rollout.device"
    with raises_kind(ConfigError, "config", match="run.device's kind") as info:
        resolve(None, ["executor=process", "rollout.device=cuda:1"])
    assert info.value.key == "rollout.device"
    with raises_kind(ConfigError, "config", match="'cuda:N'"):
        resolve(None, ["executor=process", "rollout.device=tpu"])
