"""Train a tiny Hugging Face model on your own prompt files: ``stateshift train task.name=file ...``.

Everything is made on the spot, nothing is downloaded:

- ``model/``: a word-level tokenizer (with a small chat template) and a 2-layer
  ``Qwen2ForCausalLM`` built from a config, saved as ``model.safetensors``;
- ``train.jsonl`` / ``heldout.jsonl``: arithmetic questions
  (``{"prompt": "what is 3 + 4 ?", "answer": "7"}``); no held-out question is
  in the training file;
- the reward: the built-in ``exact_match`` against the ``answer`` field.

The run is the two lines a user types for their own files::

    stateshift train task.name=file task.train_path=train.jsonl task.heldout_path=heldout.jsonl \\
        model.family=hf model.hf_path=model reward.fn=exact_match

Run it: ``python examples/train_on_files.py [out_dir [seed]]``; ``run()`` returns the ``RunResult``.
"""

from __future__ import annotations

import json
import random
import sys
import tempfile
from pathlib import Path

SPECIAL = ["<pad>", "<eos>", "<unk>", "<user>", "<assistant>"]
#: operands are 0 .. OPERANDS - 1
OPERANDS = 10
WORDS = ["what", "is", "+", "?"] + [str(i) for i in range(2 * OPERANDS - 1)]
TEMPLATE = "{a} + {b} ?"
CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)

#: the run's settings beyond the files: small enough for a CPU test (seconds per seed). A short supervised
#: warm-up on the training answers leaves held-out accuracy low; RL raises it. staleness_threshold=0 makes the
#: schedule, and so the result for a seed, the same on every run. The tokenizer has a chat template (the tests
#: render with it); the example encodes the text as it is (task.chat_template=false): shorter prompts, which
#: this tiny model learns faster. A constant learning rate and no entropy bonus: in 150 updates the default
#: warm-up + cosine decay and the adaptive bonus left one seed of three 0.25 below the others. The symmetric PPO
#: clip (0.2 / 0.2): with the default clip-higher (0.28) these 150 updates rose by 0.15 / 0.30 / 0.35 over seeds
#: 0-2, a spread the three-seed test refuses; with 0.2 it passes, as before clip-higher became the default
SETTINGS = [
    "trainer.clip_high=0.2",
    "model.family=hf",
    "reward.fn=exact_match",
    "rollout.max_new_tokens=3",
    "rollout.n=8",
    "rollout.max_concurrent_prompts=16",
    "trainer.batch_prompts=16",
    "trainer.lr=1e-3",
    "trainer.entropy_coef=0.0",
    "trainer.lr_schedule=constant",
    "trainer.lr_warmup_steps=0",
    "trainer.entropy_target=null",
    "warmup.steps=100",
    "warmup.batch_size=32",
    "warmup.lr=3e-3",
    "task.max_prompt_len=16",
    "async_training.staleness_threshold=0",
    "task.chat_template=false",
    "run.torch_threads=1",
    "run.progress=none",
    "run.tensorboard=false",
]


def make_model(root: Path, *, seed: int = 0) -> Path:
    """A word-level tokenizer and a randomly initialised 2-layer Qwen2 causal LM in ``root/model``."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    out = root / "model"
    vocab = {w: i for i, w in enumerate(SPECIAL + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    config = Qwen2Config(
        vocab_size=len(vocab),
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=32,
        tie_word_embeddings=False,
        pad_token_id=vocab["<pad>"],
        eos_token_id=vocab["<eos>"],
    )
    torch.manual_seed(seed)
    Qwen2ForCausalLM(config).save_pretrained(out)
    return out


def make_data(root: Path, *, heldout_every: int = 5) -> tuple[Path, Path]:
    """``train.jsonl`` and ``heldout.jsonl``: every ``a + b`` with a, b < ``OPERANDS``; one pair in ``heldout_every``
    is held out (never trained on: the held-out score measures what carries over to sums not seen in training)."""
    pairs = [(a, b) for a in range(OPERANDS) for b in range(OPERANDS)]
    random.Random(1234).shuffle(pairs)
    paths = root / "train.jsonl", root / "heldout.jsonl"
    with paths[0].open("w") as train, paths[1].open("w") as held:
        for i, (a, b) in enumerate(pairs):
            line = json.dumps({"prompt": TEMPLATE.format(a=a, b=b), "answer": str(a + b)})
            (held if i % heldout_every == 0 else train).write(line + "\n")
    return paths


def run(out_dir: str | Path | None = None, *, seed: int = 0, steps: int = 150, extra: tuple[str, ...] = ()):
    """Make the model and the data under ``out_dir`` (a temporary directory if ``None``) and train; the ``RunResult``."""
    from stateshift.train import resolve, run as train

    root = Path(out_dir) if out_dir is not None else Path(tempfile.mkdtemp(prefix="stateshift-files-"))
    root.mkdir(parents=True, exist_ok=True)
    model = make_model(root)
    train_path, heldout_path = make_data(root)
    cfg = resolve(
        None,
        [
            "task.name=file",
            f"task.train_path={train_path}",
            f"task.heldout_path={heldout_path}",
            f"model.hf_path={model}",
            *SETTINGS,
            f"trainer.steps={steps}",
            f"run.seed={seed}",
            f"run.eval_every={max(steps // 4, 1)}",
            f"run.out_dir={root / 'run'}",
            *extra,
        ],
    )
    return train(cfg)


if __name__ == "__main__":
    result = run(sys.argv[1] if len(sys.argv) > 1 else None, seed=int(sys.argv[2]) if len(sys.argv) > 2 else 0)
    print(f"held-out accuracy {result.heldout_accuracy_start:.3f} -> {result.heldout_accuracy_end:.3f}")
