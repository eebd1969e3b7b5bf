"""``task.name=file``: prompts from JSONL / Parquet, a local tokenizer and model, a reward by path; bad input named."""

from __future__ import annotations

import json
import math
import random
import sys
from pathlib import Path

import pytest

from stateshift.errors import DataFileError, ModelDirError, RewardError
from stateshift.rl.build import build_task
from stateshift.rl.config import ConfigError, field_docs, resolve
from stateshift.rl.reward import Reward, final_number, load_reward_fn

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
sys.path.insert(0, str(EXAMPLES))
import train_on_files as example  # noqa: E402


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """The example's tokenizer + model directory and its two JSONL files (built once for the module)."""
    root = tmp_path_factory.mktemp("assets")
    model = example.make_model(root)
    train, held = example.make_data(root)
    return {"root": root, "model": model, "train": train, "heldout": held}


def file_cfg(assets, tmp_path, *overrides):
    return resolve(None, ["task.name=file", f"task.train_path={assets['train']}", f"task.heldout_path={assets['heldout']}",
                          f"model.hf_path={assets['model']}", "model.family=hf", *example.SETTINGS,
                          f"run.out_dir={tmp_path / 'run'}", *overrides])


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
    train = write_jsonl(tmp_path / "m.jsonl", [json.dumps({"chat": [{"role": "user", "content": "what is 1 + 2 ?"}],
                                                           "reward_model": {"ground_truth": "3"}})])
    task = build_task(file_cfg(assets, tmp_path, f"task.train_path={train}", f"task.heldout_path={train}",
                               "task.messages_key=chat", "task.answer_key=reward_model.ground_truth"))
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
    train = write_jsonl(tmp_path / "t.jsonl", [json.dumps({"prompt": "what is 1 + 2 ?", "answer": "3"}),
                                               json.dumps({"prompt": long, "answer": "10"})])
    with pytest.warns(UserWarning, match=r"skipped 1 prompt.*t.jsonl:2 \(24 tokens\).*not truncated"):
        task = build_task(file_cfg(assets, tmp_path, f"task.train_path={train}"))
    assert task.skipped_long == {"train": 1, "heldout": 0} and task.n_train == 1
    assert all(len(task.prompt(i)) <= 16 for i in range(len(task.rows)))
    only_long = write_jsonl(tmp_path / "l.jsonl", [json.dumps({"prompt": long})])
    with pytest.warns(UserWarning), pytest.raises(DataFileError, match="every prompt is longer") as err:
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


@pytest.mark.parametrize(("lines", "match", "line", "key"), [
    (['{"prompt": "what is 1 + 2 ?"}', '{"question": "x"}'], "no field 'prompt'", 2, "prompt"),
    (['{"prompt": "what is 1 + 2 ?"}', '', '{"prompt": "what is 1 +'], "malformed JSON", 3, None),
    (['["what is 1 + 2 ?"]'], "must hold a JSON object", 1, None),
    ([], "empty: no records", None, None),
    (['{"prompt": 7}'], "must be a string or a list", 1, "prompt"),
    (['{"prompt": ""}'], "empty prompt", 1, "prompt"),
])
def test_bad_training_file_names_file_line_and_field(assets, tmp_path, lines, match, line, key):
    bad = write_jsonl(tmp_path / "bad.jsonl", lines)
    with pytest.raises(DataFileError, match=match) as err:
        build_task(file_cfg(assets, tmp_path, f"task.train_path={bad}"))
    assert err.value.path == str(bad) and err.value.line == line and err.value.key == key
    assert str(bad) in str(err.value)


def test_missing_file_and_unknown_extension_are_named(assets, tmp_path):
    with pytest.raises(DataFileError, match="no such file"):
        build_task(file_cfg(assets, tmp_path, f"task.heldout_path={tmp_path / 'nope.jsonl'}"))
    (tmp_path / "x.csv").write_text("prompt\n")
    with pytest.raises(DataFileError, match="unknown extension '.csv'"):
        build_task(file_cfg(assets, tmp_path, f"task.train_path={tmp_path / 'x.csv'}"))


def test_messages_without_a_chat_template_are_an_error(assets, tmp_path):
    train = write_jsonl(tmp_path / "m.jsonl", [json.dumps({"prompt": [{"role": "user", "content": "1 + 2 = ?"}]})])
    with pytest.raises(DataFileError, match="need a chat template") as err:
        build_task(file_cfg(assets, tmp_path, f"task.train_path={train}", "task.chat_template=false"))
    assert err.value.line == 1


def test_config_keys_required_for_a_file_task_are_named():
    with pytest.raises(ConfigError) as err:
        resolve(None, ["task.name=file"])
    assert err.value.key == "task.train_path"
    with pytest.raises(ConfigError) as err:
        resolve(None, ["task.name=file", "task.train_path=a.jsonl", "task.heldout_path=b.jsonl"])
    assert err.value.key == "task.tokenizer_path"
    with pytest.raises(ConfigError) as err:
        resolve(None, ["task.name=file", "task.train_path=a.jsonl", "task.heldout_path=b.jsonl",
                       "model.hf_path=m", "model.family=megatron"])
    assert err.value.key == "model.family"
    with pytest.raises(ConfigError) as err:
        resolve(None, ["task.name=files"])
    assert err.value.key == "task.name"


def test_every_new_key_is_documented_for_help():
    docs = {key: doc for key, _, doc in field_docs()}
    for key in ("task.train_path", "task.heldout_path", "task.prompt_key", "task.messages_key", "task.answer_key",
                "task.max_prompt_len", "task.chat_template", "task.shuffle", "task.tokenizer_path", "reward.fn",
                "reward.on_error", "reward.correct_at"):
        assert docs[key], key


def test_tokenizer_without_eos_or_files_is_named(assets, tmp_path):
    from transformers import AutoTokenizer

    no_eos = tmp_path / "no_eos"
    tok = AutoTokenizer.from_pretrained(assets["model"], local_files_only=True)
    tok.eos_token = None
    tok.save_pretrained(no_eos)
    with pytest.raises(ModelDirError, match="no eos_token") as err:
        build_task(file_cfg(assets, tmp_path, f"task.tokenizer_path={no_eos}"))
    assert err.value.file == "tokenizer_config.json"
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelDirError, match="no tokenizer file") as err:
        build_task(file_cfg(assets, tmp_path, f"task.tokenizer_path={empty}"))
    assert err.value.file == "tokenizer.json"


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
        with pytest.raises(RewardError, match=why) as err:
            reward(bad, {}, "t.jsonl:9")
        assert err.value.sample == "t.jsonl:9" and "t.jsonl:9" in str(err.value)
    assert reward.zeroed == 0 and reward.seconds > 0


def test_on_error_zero_counts_instead_of_raising():
    reward = Reward(f"{__name__}:sample_reward", on_error="zero")
    assert reward("boom", {}, "a:1") == (0.0, False) and reward("nan", {}, "a:2") == (0.0, False)
    assert reward.zeroed == 2


@pytest.mark.parametrize(("spec", "match"), [
    ("no_such_package_xyz.mod:fn", "does not import"), (f"{__name__}:missing", "no callable 'missing'"),
    ("exactmatch", "neither a built-in"),
])
def test_a_reward_path_that_does_not_load_is_named(assets, tmp_path, spec, match):
    with pytest.raises(RewardError, match=match) as err:
        build_task(file_cfg(assets, tmp_path, f"reward.fn={spec}"))
    assert err.value.fn == spec


def test_task_warmup_pairs_need_answers(assets, tmp_path):
    train = write_jsonl(tmp_path / "q.jsonl", [json.dumps({"prompt": "what is 1 + 2 ?"})])
    task = build_task(file_cfg(assets, tmp_path, f"task.train_path={train}"))
    with pytest.raises(DataFileError, match="needs an answer") as err:
        task.warmup_batch(random.Random(0), 2)
    assert err.value.line == 1 and err.value.key == "answer"
