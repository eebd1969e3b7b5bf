"""``task.name=file``: prompts from JSONL / Parquet, a local tokenizer and model, a reward by path; bad input named."""

from __future__ import annotations

import json
import math
import random
import sys
from pathlib import Path

import pytest

from stateshift.errors import ConfigError, RunError
from stateshift.train.build import build_task
from stateshift.train.config import field_docs, resolve
from stateshift.train.reward import Reward, final_number, load_reward_fn

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
sys.path.insert(0, str(EXAMPLES))
import train_on_files as example  # noqa: E402
from raises import raises_kind  # noqa: E402


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """The example's tokenizer + model directory and its two JSONL files (built once for the module)."""
    root = tmp_path_factory.mktemp("assets")
    model = example.make_model(root)
    train, held = example.make_data(root)
    return {"root": root, "model": model, "train": train, "heldout": held}


def file_cfg(assets, tmp_path, *overrides):
    return resolve(
        None,
        [
            "task.name=file",
            f"task.train_path={assets['train']}",
            f"task.heldout_path={assets['heldout']}",
            f"model.hf_path={assets['model']}",
            "model.family=hf",
            *example.SETTINGS,
            "task.chat_template=true",
            f"run.out_dir={tmp_path / 'run'}",
            *overrides,
        ],
    )


def write_jsonl(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


# -- reading the files -------------------------------------------------------------------------------------


def test_prompts_are_rendered_with_the_chat_template_and_answers_kept(assets, tmp_path):
    task = build_task(file_cfg(assets, tmp_path))
    first = json.loads(Path(assets["train"]).read_text().splitlines()[0])
    text = task.tokenizer.decode(task.prompt(0))
    assert text == f"<user> {first['prompt']} <assistant>"
    assert task.rows[0].answer == first["answer"] and task.rows[0].source.endswith("train.jsonl:1")
    assert task.stop_token == task.tokenizer.eos_token_id and task.max_prompt_len == 16


def test_without_the_chat_template_the_text_is_encoded_as_it_is(assets, tmp_path):
    task = build_task(file_cfg(assets, tmp_path, "task.chat_template=false"))
    first = json.loads(Path(assets["train"]).read_text().splitlines()[0])
    assert task.tokenizer.decode(task.prompt(0)) == first["prompt"]


def test_messages_field_and_nested_answer_key(assets, tmp_path):
    train = write_jsonl(
        tmp_path / "m.jsonl",
        [json.dumps({"chat": [{"role": "user", "content": "what is 1 + 2 ?"}], "reward_model": {"ground_truth": "3"}})],
    )
    task = build_task(
        file_cfg(
            assets,
            tmp_path,
            f"task.train_path={train}",
            f"task.heldout_path={train}",
            "task.messages_key=chat",
            "task.answer_key=reward_model.ground_truth",
        )
    )
    assert task.tokenizer.decode(task.prompt(0)) == "<user> what is 1 + 2 ? <assistant>"
    ids = task.tokenizer.encode("3", add_special_tokens=False)
    assert task.score(0, [*ids, task.stop_token]) == (1.0, True)


def test_parquet_and_jsonl_read_the_same_samples(assets, tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    records = [json.loads(line) for line in Path(assets["train"]).read_text().splitlines()]
    table = pa.Table.from_pylist(records)
    pq.write_table(table, tmp_path / "train.parquet")
    from_jsonl = build_task(file_cfg(assets, tmp_path))
    from_parquet = build_task(file_cfg(assets, tmp_path, f"task.train_path={tmp_path / 'train.parquet'}"))
    assert from_parquet.n_train == from_jsonl.n_train == len(records)
    for i in range(from_jsonl.n_train):
        assert from_parquet.prompt(i) == from_jsonl.prompt(i)
        assert dict(from_parquet.rows[i].fields) == dict(from_jsonl.rows[i].fields)
    assert [from_parquet.sample_at(p) for p in range(300)] == [from_jsonl.sample_at(p) for p in range(300)]


def test_overlong_prompts_are_skipped_counted_and_warned_never_truncated(assets, tmp_path):
    long = "what is " + " + ".join(["1"] * 10) + " ?"
    train = write_jsonl(
        tmp_path / "t.jsonl",
        [json.dumps({"prompt": "what is 1 + 2 ?", "answer": "3"}), json.dumps({"prompt": long, "answer": "10"})],
    )
    with pytest.warns(UserWarning, match=r"skipped 1 prompt.*t.jsonl:2 \(24 tokens\).*not truncated"):
        task = build_task(file_cfg(assets, tmp_path, f"task.train_path={train}"))
    assert task.skipped_long == {"train": 1, "heldout": 0} and task.n_train == 1
    assert all(len(task.prompt(i)) <= 16 for i in range(len(task.rows)))
    only_long = write_jsonl(tmp_path / "l.jsonl", [json.dumps({"prompt": long})])
    with pytest.warns(UserWarning), raises_kind(ConfigError, "data_file", match="every prompt is longer") as err:
        build_task(file_cfg(assets, tmp_path, f"task.train_path={only_long}"))
    assert err.value.key == "task.max_prompt_len"


# -- the order of the samples -----------------------------------------------------------------------------


def test_each_epoch_is_a_permutation_fixed_by_the_seed(assets, tmp_path):
    task = build_task(file_cfg(assets, tmp_path))
    n = task.n_train
    epochs = [[task.sample_at(e * n + i) for i in range(n)] for e in range(3)]
    assert all(sorted(order) == list(range(n)) for order in epochs)
    assert epochs[0] != epochs[1] != epochs[2]
    again = build_task(file_cfg(assets, tmp_path))
    assert [again.sample_at(p) for p in range(2 * n)] == epochs[0] + epochs[1]
    other = build_task(file_cfg(assets, tmp_path, "run.seed=1"))
    assert [other.sample_at(p) for p in range(n)] != epochs[0]
    plain = build_task(file_cfg(assets, tmp_path, "task.shuffle=false"))
    assert [plain.sample_at(p) for p in range(n + 2)] == [*range(n), 0, 1]
    assert set(task.heldout()).isdisjoint(range(n)) and len(task.heldout()) == len(task.rows) - n


# -- bad input, each named ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("lines", "match", "line", "key"),
    [
        (['{"prompt": "what is 1 + 2 ?"}', '{"question": "x"}'], "no field 'prompt'", 2, "prompt"),
        (['{"prompt": "what is 1 + 2 ?"}', "", '{"prompt": "what is 1 +'], "malformed JSON", 3, None),
        (['["what is 1 + 2 ?"]'], "must hold a JSON object", 1, None),
        ([], "empty: no records", None, None),
        (['{"prompt": 7}'], "must be a string or a list", 1, "prompt"),
        (['{"prompt": ""}'], "empty prompt", 1, "prompt"),
        (['{"prompt": "   "}'], "empty prompt", 1, "prompt"),
        (['{"prompt": "what is 1 + 2 ?", "x": 1' + "0" * 5000 + "}"], "malformed JSON", 1, None),
        (["[" * 100_000], "malformed JSON", 1, None),
        (['{"prompt": "\\ud800 what is 1 + 2 ?"}'], "lone surrogate", 1, "prompt"),
    ],
)
def test_bad_training_file_names_file_line_and_field(assets, tmp_path, lines, match, line, key):
    bad = write_jsonl(tmp_path / "bad.jsonl", lines)
    with raises_kind(ConfigError, "data_file", match=match) as err:
        build_task(file_cfg(assets, tmp_path, f"task.train_path={bad}"))
    assert err.value.path == str(bad) and err.value.line == line and err.value.key == key
    assert str(bad) in str(err.value)


def test_binary_or_bom_jsonl(assets, tmp_path):
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b"\xef\xbb\xbf" + json.dumps({"prompt": "what is 1 + 2 ?", "answer": "3"}).encode() + b"\n")
    assert build_task(file_cfg(assets, tmp_path, f"task.train_path={bom}")).n_train == 1
    binary = tmp_path / "binary.jsonl"
    binary.write_bytes(b'{"prompt": "what is 1 + 2 ?"}\n\x89PNG\xff\xfe\n')
    with raises_kind(ConfigError, "data_file", match="not UTF-8") as err:
        build_task(file_cfg(assets, tmp_path, f"task.train_path={binary}"))
    assert err.value.line == 2


def test_the_task_survives_pickling_as_a_ray_actor_receives_it(assets, tmp_path):
    import pickle

    task = build_task(file_cfg(assets, tmp_path))
    copy = pickle.loads(pickle.dumps(task))
    answer = task.tokenizer.encode(str(task.rows[3].answer), add_special_tokens=False)
    assert copy.score(3, [*answer, copy.stop_token]) == task.score(3, [*answer, task.stop_token]) == (1.0, True)
    assert [copy.sample_at(p) for p in range(50)] == [task.sample_at(p) for p in range(50)]


def test_missing_file_and_unknown_extension_are_named(assets, tmp_path):
    with raises_kind(ConfigError, "data_file", match="no such file"):
        build_task(file_cfg(assets, tmp_path, f"task.heldout_path={tmp_path / 'nope.jsonl'}"))
    (tmp_path / "x.csv").write_text("prompt\n")
    with raises_kind(ConfigError, "data_file", match="unknown extension '.csv'"):
        build_task(file_cfg(assets, tmp_path, f"task.train_path={tmp_path / 'x.csv'}"))


def test_messages_without_a_chat_template_are_an_error(assets, tmp_path):
    train = write_jsonl(tmp_path / "m.jsonl", [json.dumps({"prompt": [{"role": "user", "content": "1 + 2 = ?"}]})])
    with raises_kind(ConfigError, "data_file", match="need a chat template") as err:
        build_task(file_cfg(assets, tmp_path, f"task.train_path={train}", "task.chat_template=false"))
    assert err.value.line == 1


def test_config_keys_required_for_a_file_task_are_named():
    with raises_kind(ConfigError, "config") as err:
        resolve(None, ["task.name=file"])
    assert err.value.key == "task.train_path"
    with raises_kind(ConfigError, "config") as err:
        resolve(None, ["task.name=file", "task.train_path=a.jsonl", "task.heldout_path=b.jsonl"])
    assert err.value.key == "task.tokenizer_path"
    with raises_kind(ConfigError, "config") as err:
        resolve(
            None,
            [
                "task.name=file",
                "task.train_path=a.jsonl",
                "task.heldout_path=b.jsonl",
                "model.hf_path=m",
                "model.family=megatron",
            ],
        )
    assert err.value.key == "model.family"
    with raises_kind(ConfigError, "config") as err:
        resolve(None, ["task.name=files"])
    assert err.value.key == "task.name"


def test_every_new_key_is_documented_for_help():
    docs = {key: doc for key, _, doc in field_docs()}
    for key in (
        "task.train_path",
        "task.heldout_path",
        "task.prompt_key",
        "task.messages_key",
        "task.answer_key",
        "task.max_prompt_len",
        "task.chat_template",
        "task.shuffle",
        "task.tokenizer_path",
        "reward.fn",
        "reward.on_error",
        "reward.correct_at",
    ):
        assert docs[key], key


def test_tokenizer_without_eos_or_files_is_named(assets, tmp_path):
    from transformers import AutoTokenizer

    no_eos = tmp_path / "no_eos"
    tok = AutoTokenizer.from_pretrained(assets["model"], local_files_only=True)
    tok.eos_token = None
    tok.save_pretrained(no_eos)
    with raises_kind(ConfigError, "model_dir", match="no eos_token") as err:
        build_task(file_cfg(assets, tmp_path, f"task.tokenizer_path={no_eos}"))
    assert err.value.name == "tokenizer_config.json"
    empty = tmp_path / "empty"
    empty.mkdir()
    with raises_kind(ConfigError, "model_dir", match="no tokenizer file") as err:
        build_task(file_cfg(assets, tmp_path, f"task.tokenizer_path={empty}"))
    assert err.value.name == "tokenizer.json"


# -- rewards ------------------------------------------------------------------------------------------------


def test_builtin_verifiers():
    assert load_reward_fn("exact_match")(" 7 ", {"ground_truth": 7}) == 1.0
    assert load_reward_fn("exact_match")("7 8", {"ground_truth": "7"}) == 0.0
    numeric = load_reward_fn("numeric")
    assert numeric("so 3 then \\boxed{1,024} and 5", {"ground_truth": "1024"}) == 1.0
    assert numeric("first 3, finally 12.50", {"ground_truth": 12.5}) == 1.0
    assert numeric("\\boxed{\\frac{1}{2}} 7", {"ground_truth": "7"}) == 0.0  # the boxed answer wins
    assert numeric("no number", {"ground_truth": "1"}) == 0.0
    assert final_number("-3e2 apples") == -300.0


def sample_reward(response, sample):
    if response == "boom":
        raise KeyError("no such thing")
    if response == "nan":
        return math.nan
    if response == "dict":
        return {"score": 0.25, "acc": True}
    return {"value": 1} if response == "nokey" else float(len(response))


def test_a_reward_by_path_scores_and_errors_name_the_sample():
    reward = Reward(f"{__name__}:sample_reward")
    assert reward("abc", {}, "t.jsonl:3") == (3.0, True)
    assert reward("dict", {}, "t.jsonl:3") == (0.25, True)
    for bad, why in (("boom", "KeyError"), ("nan", "non-finite"), ("nokey", "without 'score'")):
        with raises_kind(RunError, "reward", match=why) as err:
            reward(bad, {}, "t.jsonl:9")
        assert err.value.sample == "t.jsonl:9" and "t.jsonl:9" in str(err.value)
    assert reward.zeroed == 0 and reward.seconds > 0


def test_on_error_zero_counts_instead_of_raising():
    reward = Reward(f"{__name__}:sample_reward", on_error="zero")
    assert reward("boom", {}, "a:1") == (0.0, False) and reward("nan", {}, "a:2") == (0.0, False)
    assert reward.zeroed == 2


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("no_such_package_xyz.mod:fn", "does not import"),
        (f"{__name__}:missing", "no callable 'missing'"),
        ("exactmatch", "neither a built-in"),
    ],
)
def test_a_reward_path_that_does_not_load_is_named(assets, tmp_path, spec, match):
    with raises_kind(RunError, "reward", match=match) as err:
        build_task(file_cfg(assets, tmp_path, f"reward.fn={spec}"))
    assert err.value.fn == spec


def test_task_warmup_pairs_need_answers(assets, tmp_path):
    train = write_jsonl(tmp_path / "q.jsonl", [json.dumps({"prompt": "what is 1 + 2 ?"})])
    task = build_task(file_cfg(assets, tmp_path, f"task.train_path={train}"))
    with raises_kind(ConfigError, "data_file", match="needs an answer") as err:
        task.warmup_batch(random.Random(0), 2)
    assert err.value.line == 1 and err.value.key == "answer"


# -- runs: end to end, resume -------------------------------------------------------------------------------

RUN = [
    "warmup.steps=5",
    "trainer.batch_prompts=4",
    "rollout.n=4",
    "rollout.max_concurrent_prompts=4",
    "async_training.staleness_threshold=0",
    "run.checkpoint_every=4",
    "run.eval_every=1000",
    "run.plot=false",
    "task.heldout_size=8",
]


def small_train(assets, tmp_path) -> Path:
    """12 training rows: a run of 8 steps x 4 prompts goes through more than two epochs of them."""
    lines = Path(assets["train"]).read_text().splitlines()[:12]
    return write_jsonl(tmp_path / "small.jsonl", lines)


def test_resume_mid_epoch_continues_at_the_same_sample(assets, tmp_path, monkeypatch):
    from stateshift.train import run
    from stateshift.train.checkpointing import latest_checkpoint
    from stateshift.train.sidecar import read_sidecar
    from stateshift.train.trainer import Trainer

    trained: list[tuple[int, tuple[int, ...]]] = []  # (row, prompt) of every group trained, in order
    update = Trainer.update
    monkeypatch.setattr(
        Trainer,
        "update",
        lambda self, batch, timer, **kw: (
            trained.extend((g.item, g.prompt) for g in batch.groups),
            update(self, batch, timer, **kw),
        )[1],
    )
    train = small_train(assets, tmp_path)
    run(file_cfg(assets, tmp_path / "a", f"task.train_path={train}", "trainer.steps=8", *RUN))
    whole, trained[:] = list(trained), []
    first = run(file_cfg(assets, tmp_path / "b", f"task.train_path={train}", "trainer.steps=4", *RUN))
    side = read_sidecar(latest_checkpoint(first.out_dir / "checkpoints"))
    pos = {k: v for k, v in side.extra.items() if k.startswith("data_")}
    assert set(pos) == {"data_samples", "data_epoch", "data_offset", "data_train_sha256"}
    assert pos["data_samples"] == side.capture.next_uid and 0 < pos["data_offset"] < 12 and pos["data_epoch"] >= 1
    assert all(isinstance(v, (int, str)) for v in pos.values())
    resumed = run(
        file_cfg(assets, tmp_path / "b", f"task.train_path={train}", "trainer.steps=8", *RUN), resume=first.out_dir
    )
    assert trained == whole and len(whole) == 32  # the same rows, in the same order, across the resume
    rows = [row for row, _ in whole]
    assert sorted(rows[:12]) == sorted(rows[12:24]) == list(range(12)) and rows[:12] != rows[12:24]
    assert resumed.summary["status"] == "finished"
    record = json.loads((first.out_dir / "metrics.jsonl").read_text().splitlines()[-1])
    assert record["time_reward_s_total"] > 0 and record["reward_zeroed_total"] == 0


def test_resume_refuses_a_training_file_that_changed(assets, tmp_path):
    from stateshift.train import run

    train = small_train(assets, tmp_path)
    first = run(file_cfg(assets, tmp_path, f"task.train_path={train}", "trainer.steps=4", *RUN))
    train.write_text(train.read_text() + json.dumps({"prompt": "what is 1 + 1 ?", "answer": "2"}) + "\n")
    config = (first.out_dir / "config.yaml").read_bytes()
    with raises_kind(ConfigError, "data_file", match="changed since the checkpoint") as err:
        run(file_cfg(assets, tmp_path, f"task.train_path={train}", "trainer.steps=8", *RUN), resume=first.out_dir)
    assert err.value.key == "task.train_path"
    assert (first.out_dir / "config.yaml").read_bytes() == config  # a refused resume changes nothing


# -- the model directory --------------------------------------------------------------------------------------


def test_sharded_safetensors_load_the_same_weights_and_a_missing_shard_is_named(assets, tmp_path):
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    from stateshift.train.build import load_hf

    sharded = tmp_path / "sharded"
    shutil.copytree(assets["model"], sharded)
    (sharded / "model.safetensors").unlink()
    AutoModelForCausalLM.from_pretrained(assets["model"], local_files_only=True).save_pretrained(
        sharded, max_shard_size="20KB"
    )
    shards = sorted(sharded.glob("model-*.safetensors"))
    assert len(shards) > 1 and (sharded / "model.safetensors.index.json").is_file()
    whole = load_hf(str(assets["model"]), 1, seed=0).state_dict()
    parts = load_hf(str(sharded), 1, seed=1).state_dict()  # another seed: the weights come from the files
    assert whole.keys() == parts.keys() and all(torch.equal(whole[k], parts[k]) for k in whole)
    shards[1].unlink()
    with raises_kind(ConfigError, "model_dir", match="listed in model.safetensors.index.json but missing") as err:
        load_hf(str(sharded), 1, seed=0)
    assert err.value.name == shards[1].name
    (sharded / "config.json").unlink()
    with raises_kind(ConfigError, "model_dir") as err:
        load_hf(str(sharded), 1, seed=0)
    assert err.value.name == "config.json"


def _model_copy(assets, tmp_path, name: str) -> Path:
    import shutil

    copy = tmp_path / name
    shutil.copytree(assets["model"], copy)
    return copy


@pytest.mark.parametrize("auto_map_in", ["config.json", "tokenizer_config.json"])
def test_a_model_directory_that_asks_for_its_own_code_is_refused_and_none_of_it_runs(assets, tmp_path, auto_map_in):
    """transformers asks on a terminal whether to run a directory's ``auto_map`` code (and runs it on "y"): a model
    directory from anywhere must never get its code run, asked or not."""
    from stateshift.train.build import load_hf
    from stateshift.train.hf_dir import load_tokenizer

    model = _model_copy(assets, tmp_path, "remote")
    marker = tmp_path / "RAN"
    (model / "evil.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    conf = json.loads((model / auto_map_in).read_text())
    conf["auto_map"] = {"AutoConfig": "evil.C", "AutoModelForCausalLM": "evil.M", "AutoTokenizer": ["evil.T", None]}
    if auto_map_in == "config.json":
        conf["model_type"] = "evilmodel"
    (model / auto_map_in).write_text(json.dumps(conf))
    load = (lambda: load_hf(str(model), 1, seed=0)) if auto_map_in == "config.json" else lambda: load_tokenizer(model)
    with raises_kind(ConfigError, "model_dir", match="auto_map") as err:
        load()
    assert err.value.name == auto_map_in and not marker.exists()


def test_a_model_directory_transformers_cannot_load_is_a_config_error_naming_it(assets, tmp_path):
    import os
    import pickle

    from stateshift.train.build import load_hf
    from stateshift.train.hf_dir import load_tokenizer

    pickled = _model_copy(assets, tmp_path, "pickled")
    (pickled / "model.safetensors").unlink()
    marker = tmp_path / "RAN"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    (pickled / "pytorch_model.bin").write_bytes(pickle.dumps({"w": Evil()}))
    with raises_kind(ConfigError, "model_dir") as err:
        load_hf(str(pickled), 1, seed=0)
    assert err.value.name == "pytorch_model.bin" and not marker.exists()
    huge = _model_copy(assets, tmp_path, "huge")
    (huge / "model.safetensors").unlink()
    conf = json.loads((huge / "config.json").read_text())
    (huge / "config.json").write_text(json.dumps({**conf, "hidden_size": 1 << 24, "intermediate_size": 1 << 24}))
    with raises_kind(ConfigError, "model_dir") as err:
        load_hf(str(huge), 1, seed=0)
    broken = _model_copy(assets, tmp_path, "broken")
    (broken / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "Nope"}}')
    with raises_kind(ConfigError, "model_dir") as err:
        load_tokenizer(broken)
    assert err.value.name == "tokenizer.json"


def test_too_few_positions_is_a_config_error(assets, tmp_path):
    from stateshift.train.build import build_policy

    cfg = file_cfg(assets, tmp_path, "task.max_prompt_len=40")
    with raises_kind(ConfigError, "config", match="max_position_embeddings 32 < 43") as err:
        build_policy(cfg, build_task(cfg))
    assert err.value.key == "model.hf_path"


@pytest.mark.parametrize("family", ["fsdp2", "builtin"])
def test_other_families_train_on_files(assets, tmp_path, family):
    """fsdp2 starts from the directory's weights (sharded); builtin: the built-in GPT at the tokenizer's vocabulary."""
    import torch

    from stateshift.train import run
    from stateshift.train.build import build_policy, load_hf
    from stateshift.train.policies.plain import full_state_dict

    cfg = file_cfg(assets, tmp_path, f"model.family={family}", "trainer.steps=2", *RUN)
    task = build_task(cfg)
    policy = build_policy(cfg, task)
    if family == "fsdp2":
        want = load_hf(str(assets["model"]), 1, seed=5).state_dict()
        got = full_state_dict(policy.model)
        assert got.keys() == want.keys() and all(torch.equal(got[k].cpu(), want[k]) for k in want)
    else:
        assert policy.model.cfg.vocab == task.vocab_size and policy.model.cfg.max_len == 16 + 3
    del policy
    result = run(cfg)
    assert result.summary["status"] == "finished" and result.steps == 2
