"""The configuration of ``stateshift train``: nested dataclasses, a YAML file and ``key=value`` overrides.

Every field has a docstring (shown by ``stateshift train --help``). Values are
checked where they are read: an unknown key or a value of the wrong type or
range raises ``ConfigError`` naming the dotted key (``trainer.lr``), before
anything runs. ``resolve(path, overrides)`` gives the config a run uses; the
run saves it as ``config.yaml`` beside its outputs.

Names follow verl's fully-async mode where it has one
(``async_training.staleness_threshold``, ``trigger_parameter_sync_step``,
``require_batches``, ``partial_rollout``) and AReaL's for its admission rule
(``max_head_offpolicyness``).
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import inspect
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from ..errors import ConfigError, show


def _check(key: str, ok: bool, reason: str) -> None:
    if not ok:
        raise ConfigError("config", reason, key=key)


@dataclass(kw_only=True, slots=True)
class TaskConfig:
    """The task: a built-in one (``train/tasks/addition.py``, ``train/tasks/longtail.py``) or the user's own files
    (``train/tasks/files.py``)."""

    name: Literal["addition", "longtail", "file"] = "addition"
    """'addition': procedural 3-digit addition, answer least-significant digit first (responses of 5 tokens);
    'longtail': running sums of k two-digit numbers, k log-uniform in [min_terms, max_terms], each term copied and
    each partial sum written out (responses of 7k tokens: 14 to 448 at the defaults; needs rollout.max_new_tokens
    >= 7 * max_terms); 'file': prompts from task.train_path / task.heldout_path, tokenized by the
    tokenizer of model.hf_path (or task.tokenizer_path), scored by reward.fn"""
    digit_credit: float = 0.05
    """addition: reward per correct answer digit in place, on top of 1 for an exact answer"""
    stop_credit: float = 0.1
    """reward for a response that ends with the stop token (within rollout.max_new_tokens), on top of the rest:
    keeps the stop-token rate from collapsing"""
    heldout_size: int = 500
    """held-out prompts evaluated (greedy) for the held-out accuracy; never trained on (file: the first this many
    of task.heldout_path)"""
    min_terms: int = 2
    """longtail: fewest terms k of a problem"""
    max_terms: int = 64
    """longtail: most terms k of a problem (k is log-uniform in [min_terms, max_terms])"""
    warmup_max_terms: int = 8
    """longtail: the supervised warm-up's easy cases have at most this many terms"""
    partial_credit: float = 0.2
    """longtail: reward for correct partial sums in place, this times their fraction, on top of 1 for the exact
    final sum followed by the stop token"""
    train_path: str = ""
    """file: the training prompts, a .jsonl (one JSON object per line) or .parquet file"""
    heldout_path: str = ""
    """file: the held-out prompts (same format and fields), evaluated, never trained on"""
    prompt_key: str = "prompt"
    """file: the record field holding the prompt: text, or a list of chat messages ({role, content}); dotted
    names reach into nested objects (a.b)"""
    messages_key: str = ""
    """file: a record field of chat messages to use instead of prompt_key ('': none)"""
    answer_key: str = "answer"
    """file: the record field holding the answer / ground truth, handed to the reward as sample['ground_truth']
    and the target of the supervised warm-up (dotted names reach into nested objects, e.g. reward_model.ground_truth)"""
    max_prompt_len: int = 128
    """file: longest prompt in tokens (after the chat template); longer ones are skipped with a warning and
    counted, never truncated"""
    chat_template: bool = True
    """file: render prompts with the tokenizer's chat template when it has one (a text prompt becomes one user
    message); false: encode the text as it is"""
    shuffle: bool = True
    """file: visit the training rows in a new order each epoch, fixed by run.seed (false: the file's order)"""
    tokenizer_path: str = ""
    """file: local directory of the Hugging Face tokenizer ('': model.hf_path); nothing is downloaded"""

    def __post_init__(self) -> None:
        for name in ("digit_credit", "stop_credit", "partial_credit"):
            _check(f"task.{name}", 0 <= getattr(self, name) <= 1, "must be in [0, 1]")
        _check("task.heldout_size", self.heldout_size > 0, "must be > 0")
        _check("task.min_terms", self.min_terms >= 1, "must be >= 1")
        _check("task.max_terms", self.max_terms >= self.min_terms, "must be >= task.min_terms")
        _check("task.max_terms", self.max_terms <= 101, "must be <= 101 (partial sums of 4 digits)")
        _check(
            "task.warmup_max_terms",
            self.min_terms <= self.warmup_max_terms <= self.max_terms,
            "must be in [task.min_terms, task.max_terms]",
        )
        _check("task.max_prompt_len", self.max_prompt_len > 0, "must be > 0")
        if self.name == "file":
            for key in ("train_path", "heldout_path", "prompt_key"):
                _check(f"task.{key}", bool(getattr(self, key)), "is required when task.name=file")


@dataclass(kw_only=True, slots=True)
class RewardConfig:
    """The reward of task.name=file (``train/reward.py``); the addition task has its own."""

    fn: str = "exact_match"
    """'exact_match' (response == ground truth, stripped), 'numeric' (the last \\boxed{} or last number equals
    the ground truth as a number), or 'package.module:function', called as fn(response: str, sample: mapping of the
    record's fields plus ground_truth) -> float or {'score': float, 'acc': bool (optional)}; imported once"""
    on_error: Literal["raise", "zero"] = "raise"
    """a reward that raises or returns a non-finite score: 'raise' stops the run with RunError("reward") naming the
    sample; 'zero' scores it 0 and counts it (reward_zeroed_total in the metrics)"""
    correct_at: float = 1.0
    """a response counts as correct (accuracy, held-out accuracy) when its score is at least this, unless the
    function returns an 'acc'"""


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    """The policy: the built-in GPT, a Hugging Face causal LM, a Megatron-core GPT or an FSDP2-sharded Qwen2."""

    family: Literal["builtin", "hf", "megatron", "fsdp2"] = "builtin"
    """'builtin': the ~100K-parameter GPT of train/tasks/gpt.py; 'hf': a transformers causal LM from hf_path;
    'megatron': a megatron-core GPTModel (local spec, bf16, Float16Module, DDP + distributed optimizer, Adam;
    needs run.device=cuda and megatron-core); 'fsdp2': a transformers Qwen2ForCausalLM built from a config
    (no download) with fully_shard per layer and on the root, world size 1 (fp32). The sizes below apply to
    all three built ones"""
    width: int = 64
    """builtin, megatron, fsdp2: model width (hidden size)"""
    layers: int = 2
    """builtin, megatron, fsdp2: transformer blocks"""
    heads: int = 4
    """builtin, megatron, fsdp2: attention heads (must divide width)"""
    positions: Literal["learned", "rotary"] = "learned"
    """builtin: 'learned' position embeddings, or 'rotary' (attention sees offsets between tokens only: a lookup at
    a constant distance back, as the long-tail task's copies are, holds at every position, trained or not)"""
    hf_path: str = ""
    """hf: a local directory with config.json and weights (model.safetensors, sharded ones with their index, or
    none: initialised from the config); fsdp2: if set, the initial weights and architecture instead of the built
    Qwen2; task.name=file: its tokenizer too. Never downloaded: a missing file is an error naming it"""

    def __post_init__(self) -> None:
        for name in ("width", "layers", "heads"):
            _check(f"model.{name}", getattr(self, name) > 0, "must be > 0")
        _check("model.width", self.width % self.heads == 0, f"must be divisible by model.heads ({self.heads})")
        _check("model.positions", self.positions in ("learned", "rotary"), "must be 'learned' or 'rotary'")
        _check(
            "model.positions",
            self.positions == "learned" or (self.width // self.heads) % 2 == 0,
            "rotary needs an even head width (model.width / model.heads)",
        )
        _check("model.hf_path", self.family != "hf" or bool(self.hf_path), "is required when model.family=hf")


@dataclass(kw_only=True, slots=True)
class WarmupConfig:
    """Supervised warm-up on easy (no-carry) problems before RL."""

    steps: int = 400
    """optimizer steps of teacher-forced cross entropy on the answer (0: no warm-up)"""
    batch_size: int = 64
    """problems per warm-up step"""
    lr: float = 3e-3
    """Adam learning rate of the warm-up"""
    label_smoothing: float = 0.3
    """label smoothing of the warm-up loss (keeps some probability on other digits, so RL can explore)"""

    def __post_init__(self) -> None:
        _check("warmup.steps", self.steps >= 0, "must be >= 0")
        _check("warmup.batch_size", self.batch_size > 0, "must be > 0")
        _check("warmup.lr", self.lr > 0, "must be > 0")
        _check("warmup.label_smoothing", 0 <= self.label_smoothing < 1, "must be in [0, 1)")


@dataclass(kw_only=True, slots=True)
class RolloutConfig:
    """The rollouter: batched KV-cached sampling with the weights it was last sent."""

    n: int = 8
    """responses per prompt (the GRPO group size)"""
    max_concurrent_prompts: int = 32
    """prompts generated at once (one wave; each has n rows)"""
    temperature: float = 1.0
    """sampling temperature (log-probs on both sides are of the temperature-scaled distribution)"""
    top_p: float = 1.0
    """nucleus sampling: draw only from the smallest set of tokens holding this probability"""
    max_new_tokens: int = 5
    """longest response (the addition task needs 5: four digits and the stop token; longtail 7 * task.max_terms)"""
    batching: Literal["wave", "continuous"] = "wave"
    """'wave': a batch of max_concurrent_prompts prompts starts together and ends with its longest response;
    'continuous': max_concurrent_prompts * n row slots, a finished row replaced by a row of a new prompt at once
    and each group queued as soon as its n rows are done, over a static KV cache (follows the mean response
    length, not the max; train/continuous.py; built-in model, executor=inprocess or process, no checkpoints in
    this version)"""
    device: str | None = None
    """executor=process: where the rollouter process computes ('cuda:N'); null: the trainer's device (run.device)"""
    weight_transport: Literal["builtin", "auto", "shared_host", "cuda_ipc"] = "auto"
    """executor=process: how weights reach the rollouter process. 'auto' (cuda_ipc when both sides are on the same
    GPU, else shared_host), 'shared_host' and 'cuda_ipc' go through the weight-sync library (stateshift.rl.sync)
    over the trainer's state: 'shared_host' publishes from the trainer's host pool, then shared memory (no D2H
    while the params are offloaded), 'cuda_ipc' the trainer's GPU memory (one GPU); 'builtin': one shared-memory
    file the trainer copies each sync into"""
    max_restarts: int = 3
    """executor=process: a rollouter process that dies (killed, OOM) is reported and restarted with the newest
    weights at most this many times per run; the next death stops the run with RunError("rollout_died")"""

    def __post_init__(self) -> None:
        _check("rollout.n", self.n >= 2, "must be >= 2 (GRPO needs a group)")
        _check("rollout.max_concurrent_prompts", self.max_concurrent_prompts > 0, "must be > 0")
        _check("rollout.temperature", self.temperature > 0, "must be > 0 (sampling)")
        _check("rollout.top_p", 0 < self.top_p <= 1, "must be in (0, 1]")
        _check("rollout.max_new_tokens", self.max_new_tokens > 0, "must be > 0")
        _check(
            "rollout.device",
            self.device is None or self.device == "cpu" or self.device.startswith("cuda"),
            "must be null, 'cpu' or 'cuda:N'",
        )
        _check("rollout.max_restarts", self.max_restarts >= 0, "must be >= 0")
        _check(
            "rollout.weight_transport",
            self.weight_transport != "cuda_ipc" or (self.device or "cuda").startswith("cuda"),
            "cuda_ipc needs the rollouter on a GPU",
        )


@dataclass(kw_only=True, slots=True)
class AsyncConfig:
    """Staleness control between rollouter and trainer (verl fully-async names and defaults)."""

    mode: Literal["async", "sync"] = "async"
    """'async': the rollouter generates the next samples while the trainer trains (the rules below); 'sync': the
    same algorithm without overlap: each version's samples are generated first (staleness 0: exactly
    trigger_parameter_sync_step * require_batches mini-batches, whatever staleness_threshold says), then trained
    on with the same updates per version as async (the baseline of a fair comparison)"""
    staleness_threshold: float = 0.1
    """verl: the rollouter pauses once the groups admitted since the last sync reach
    required * (1 + staleness_threshold) * trigger_parameter_sync_step (0: on-policy per sync)"""
    trigger_parameter_sync_step: int = 4
    """verl: trainer steps between two weight syncs to the rollouter (param_version += 1 at each)"""
    require_batches: int = 1
    """verl: mini-batches (of trainer.batch_prompts groups) one trainer step consumes, one optimizer update each"""
    partial_rollout: bool = True
    """verl: on a sync, generations in flight pause, take the new weights and resume with their tokens kept;
    off: the sync waits for the wave in flight to finish first"""
    max_head_offpolicyness: int | None = None
    """AReaL: also admit a prompt only while (eta + version + 1) * required >= accepted + running (0: synchronous)"""
    max_queue_size: int | None = None
    """groups the queue may hold, counting those in flight (default: the staleness budget)"""
    max_lag: int | None = None
    """discard (counted, with the reason) groups whose oldest token is more than this many versions behind"""

    def __post_init__(self) -> None:
        _check("async_training.staleness_threshold", self.staleness_threshold >= 0, "must be >= 0")
        _check("async_training.trigger_parameter_sync_step", self.trigger_parameter_sync_step >= 1, "must be >= 1")
        _check("async_training.require_batches", self.require_batches >= 1, "must be >= 1")
        _check(
            "async_training.max_head_offpolicyness",
            self.max_head_offpolicyness is None or self.max_head_offpolicyness >= 0,
            "must be >= 0 or null",
        )
        _check(
            "async_training.max_queue_size",
            self.max_queue_size is None or self.max_queue_size >= 1,
            "must be >= 1 or null",
        )
        _check("async_training.max_lag", self.max_lag is None or self.max_lag >= 0, "must be >= 0 or null")


@dataclass(kw_only=True, slots=True)
class TrainerConfig:
    """The trainer: GRPO advantages, the clipped loss, old log-probs, offload between phases."""

    steps: int = 2000
    """trainer steps of RL"""
    batch_prompts: int = 32
    """groups per mini-batch (verl: ppo_mini_batch_size)"""
    lr: float = 2e-3
    """peak Adam learning rate (of the built-in ~100K-parameter model: bigger models want less, e.g. 1e-4 to 5e-4) (after lr_warmup_steps; the optimizer state starts fresh for RL in every family)"""
    lr_warmup_steps: int = 10
    """optimizer updates of linear learning-rate warm-up from lr / lr_warmup_steps to lr (0: none)"""
    lr_schedule: Literal["constant", "cosine", "linear"] = "cosine"
    """after the warm-up: 'constant' lr, or 'cosine' / 'linear' decay to lr * lr_min_ratio at the last update
    (trainer.steps * async_training.require_batches updates)"""
    lr_min_ratio: float = 0.1
    """the decayed learning rate at the end, as a fraction of lr"""
    grad_clip: float = 1.0
    """clip the gradient norm at this (0: off)"""
    old_logprob: Literal["bypass", "pi_old", "proximal", "loglinear"] = "pi_old"
    """l_p: 'bypass' the rollout's l_b; 'pi_old' recomputed under the weights of the last sync (a snapshot,
    PiOldCycle) before each update; 'proximal' computed ONCE per trainer step, under the weights at its start, for
    all its require_batches mini-batch updates (AReaL decoupled PPO: the clip binds from the second on);
    'loglinear' AReaL's approximation of 'proximal' without its forward, l_b + a (l_t - l_b) with a from the
    versions"""
    norm_adv_std: bool = True
    """divide GRPO advantages by the group's reward std"""
    clip_low: float = 0.2
    """PPO clip: ratio >= 1 - clip_low"""
    clip_high: float = 0.28
    """PPO clip: ratio <= 1 + clip_high (DAPO's clip-higher: above clip_low, so that unlikely tokens can gain
    and the policy keeps exploring; 0.2 as verl's default left 2 of 4 seeds of the default run stuck at 0.58-0.64)"""
    clip_c: float = 3.0
    """dual clip for negative advantages: loss <= clip_c * |A| (verl clip_ratio_c)"""
    behaviour_weight: Literal["truncate", "mask"] = "truncate"
    """w = exp(l_p - l_b): 'truncate' min(w, weight_cap) (TIS), 'mask' drop tokens outside [weight_lo, weight_hi]"""
    weight_level: Literal["token", "sequence_product", "sequence_geomean"] = "token"
    """behaviour weight per token; or per sequence, the product of its tokens' weights ('sequence_product',
    verl's 'sequence') or their geometric mean ('sequence_geomean', verl's 'geometric')"""
    weight_cap: float = 2.0
    """truncation cap C of the behaviour weight"""
    weight_lo: float = 0.5
    """mask: lowest behaviour weight kept"""
    weight_hi: float = 2.0
    """mask: highest behaviour weight kept"""
    entropy_coef: float = 0.0
    """fixed coefficient of an entropy bonus in the loss (verl entropy_coeff, default 0 as there: a fixed 0.15
    collapsed the stop-token rate on the GPU, docs/guide/rl.md); the adaptive part below comes on top"""
    entropy_target: float | None = 0.7
    """adaptive entropy bonus: its coefficient (from 0) rises while the mean per-token entropy of the update's
    tokens is below this many nats and falls (to 0 at least) while above, by entropy_adapt_rate * (target -
    entropy) per update, capped at entropy_coef_max: off while the policy explores, on when it collapses.
    null: off (then only entropy_coef). Per token: long responses want a lower target"""
    entropy_adapt_rate: float = 0.02
    """adaptive entropy bonus: coefficient change per update and nat of distance to entropy_target"""
    entropy_coef_max: float = 0.15
    """adaptive entropy bonus: the largest coefficient it reaches"""
    kl_coef: float = 0.0
    """coefficient of KL(current || reference) in the loss; the reference is a snapshot of the weights at RL start"""
    param_offload: bool = True
    """offload params to host while the trainer waits for samples (not between two updates it runs back to back)"""
    grad_offload: bool = False
    """offload grads to host while the trainer waits for samples"""
    optimizer_offload: bool = False
    """offload optimizer state to host while the trainer waits for samples"""
    prefetch: bool = False
    """start bringing back what was offloaded before the phase that reads it, so the copy overlaps compute (on a
    CUDA stream of its own: train/prefetch.py): params, grads and optimizer state once a step's samples are in
    hand (right after the old log-prob forward when that is a pi_old swap), each waited for just before its first
    read (the optimizer state: before the backward and optimizer step). Costs device memory for those groups
    during the forwards. false: each group is brought back, and waited for, where it is first needed.
    Off by default: on one GPU it trains the same bits as off (tests/gpu/test_rl_prefetch_gpu.py: builtin,
    fsdp2, megatron) and hides most of a 1.07 GB onload behind a forward (benchmarks/prefetch_bench.py), but its
    effect on a whole trainer step is not measured yet"""
    freed_memory: Literal["auto", "driver", "cache"] = "auto"
    """what an offload does with the device memory it frees: 'driver' hands it back to the CUDA driver
    (torch.cuda.empty_cache(): another process can take it; the offload waits for its copies, the next onload
    allocates anew); 'cache' keeps it in this process's caching allocator (cheaper offloads and onloads). 'auto':
    'driver' when a rollouter in another process may share the trainer's GPU (executor=process with
    rollout.device null or the trainer's GPU, executor=ray), 'cache' otherwise: executor=inprocess (the rollout
    thread allocates from the same caching allocator, which releases its unused cached blocks itself and retries
    before an allocation fails), a rollouter process on another GPU, run.device=cpu (no effect there)"""

    def __post_init__(self) -> None:
        _check("trainer.steps", self.steps >= 0, "must be >= 0")
        _check("trainer.batch_prompts", self.batch_prompts >= 1, "must be >= 1")
        _check("trainer.lr_warmup_steps", self.lr_warmup_steps >= 0, "must be >= 0")
        _check("trainer.lr_min_ratio", 0 <= self.lr_min_ratio <= 1, "must be in [0, 1]")
        for name in ("lr", "weight_cap", "weight_lo", "weight_hi", "clip_c"):
            _check(f"trainer.{name}", getattr(self, name) > 0, "must be > 0")
        _check("trainer.entropy_target", self.entropy_target is None or self.entropy_target > 0, "must be > 0 or null")
        for name in (
            "clip_low",
            "clip_high",
            "grad_clip",
            "kl_coef",
            "entropy_coef",
            "entropy_adapt_rate",
            "entropy_coef_max",
        ):
            _check(f"trainer.{name}", getattr(self, name) >= 0, "must be >= 0")
        _check("trainer.clip_low", self.clip_low < 1, "must be < 1")
        _check("trainer.clip_c", self.clip_c > 1, "must be > 1 (dual clip)")
        _check("trainer.weight_lo", self.weight_lo < self.weight_hi, "must be < trainer.weight_hi")


@dataclass(kw_only=True, slots=True)
class RunConfig:
    """Seeds, outputs, checkpoints, liveness."""

    seed: int = 0
    """seed of model init, prompts, sampling (0 to 2**63 - 1)"""
    out_dir: str = "runs/train"
    """where config.yaml, metrics.jsonl, curves.png, summary.json and checkpoints go"""
    checkpoint_every: int = 0
    """save a checkpoint every this many trainer steps (a multiple of trigger_parameter_sync_step; 0: off)"""
    keep_checkpoints: int = 2
    """newest checkpoints kept"""
    eval_every: int = 100
    """held-out accuracy every this many trainer steps (and at the start and the end)"""
    torch_threads: int = 1
    """torch intra-op threads of each side (trainer thread, rollout thread), at most 1024; 0: torch's default. 1 is fastest for the
    built-in model on a shared 2-core machine (docs/notes/rl-runs.md has the numbers)"""
    watchdog_s: float = 30.0
    """report queue depth and versions when nothing moved for this long"""
    stall_timeout_s: float = 600.0
    """stop the run with an error when nothing moved for this long"""
    progress: Literal["auto", "bar", "lines", "none"] = "auto"
    """'auto': a progress bar on a terminal, plain lines otherwise; 'none': no progress output. The supervised
    warm-up prints 20 lines (step, loss, seconds) unless 'none'"""
    tensorboard: bool = True
    """write TensorBoard events too, when tensorboard is installed"""
    plot: bool = True
    """write curves.png at the end (needs matplotlib: the 'rl' extra)"""
    device: Literal["cpu", "cuda"] = "cpu"
    """where trainer, rollouter and evaluation compute: 'cpu', or 'cuda' (the current CUDA device; the rollouter's
    copy of the weights on the same GPU, on its own stream; offloaded state goes to pinned host memory and the
    freed device memory back to the driver)"""
    stop_accuracy: float | None = None
    """end the run early at the first held-out evaluation (every eval_every steps) at or above this accuracy"""
    max_wall_s: float | None = None
    """end the run early after the first trainer step that ends this many seconds after RL started (warm-up not counted)"""

    def __post_init__(self) -> None:
        if self.device == "cuda":
            import torch

            _check(
                "run.device",
                torch.cuda.is_available(),
                "is 'cuda' but torch sees no CUDA device here (torch.cuda.is_available() is False)",
            )
        _check(
            "run.stop_accuracy", self.stop_accuracy is None or 0 < self.stop_accuracy <= 1, "must be in (0, 1] or null"
        )
        _check("run.max_wall_s", self.max_wall_s is None or self.max_wall_s > 0, "must be > 0 or null")
        _check("run.checkpoint_every", self.checkpoint_every >= 0, "must be >= 0")
        _check("run.keep_checkpoints", self.keep_checkpoints >= 1, "must be >= 1")
        _check("run.eval_every", self.eval_every >= 1, "must be >= 1")
        _check("run.seed", 0 <= self.seed < 1 << 63, "must be in [0, 2**63) (what torch.manual_seed takes)")
        _check("run.torch_threads", 0 <= self.torch_threads <= 1024, "must be in [0, 1024]")
        _check("run.watchdog_s", self.watchdog_s > 0, "must be > 0")
        _check("run.stall_timeout_s", self.stall_timeout_s > self.watchdog_s, "must be > run.watchdog_s")


@dataclass(kw_only=True, slots=True)
class RayConfig:
    """The Ray executor (``executor=ray``; ``pip install 'stateshift[ray]'``): actors, placement, restarts."""

    address: str = ""
    """'' starts a private local Ray instance for the run and shuts it down at the end; 'auto' or
    'ray://host:port' joins a running cluster (then run.out_dir must be a path every node sees). A Ray
    already initialised in the calling process (ray.init before run()) is used as it is"""
    num_cpus: int | None = None
    """CPUs of the private local instance (null: all of this machine's)"""
    trainer_cpus: float = 1.0
    """CPUs of the trainer actor's bundle (the queue actor lives in it too, with no CPU of its own)"""
    rollout_cpus: float = 1.0
    """CPUs of the rollouter actor's bundle"""
    trainer_gpus: float | None = None
    """GPUs of the trainer's bundle; null: 1 when the cluster has two GPUs or more, 0.5 (sharing one with the
    rollouter) when it has one, else 0. Bundles reserve devices; where the policy computes is run.device's choice"""
    rollout_gpus: float | None = None
    """GPUs of the rollouter's bundle; null: 1 when the cluster has two GPUs or more, 0.5 (colocated with the
    trainer) when it has one, else 0"""
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    """Ray placement-group strategy for the trainer and rollouter bundles"""
    max_rollout_restarts: int = 3
    """a rollouter actor that dies (killed, OOM, its node lost) is reported and restarted from the last weights
    it was sent, at most this many times per run; the next death stops the run with RunError("rollout_died")"""
    ready_timeout_s: float = 120.0
    """seconds the placement group and each actor may take to come up (a cluster without room fails after this)"""

    def __post_init__(self) -> None:
        _check("ray.num_cpus", self.num_cpus is None or self.num_cpus >= 1, "must be >= 1 or null")
        _check("ray.trainer_cpus", self.trainer_cpus > 0, "must be > 0")
        _check("ray.rollout_cpus", self.rollout_cpus > 0, "must be > 0")
        _check("ray.trainer_gpus", self.trainer_gpus is None or self.trainer_gpus >= 0, "must be >= 0 or null")
        _check("ray.rollout_gpus", self.rollout_gpus is None or self.rollout_gpus >= 0, "must be >= 0 or null")
        _check("ray.max_rollout_restarts", self.max_rollout_restarts >= 0, "must be >= 0")
        _check("ray.ready_timeout_s", self.ready_timeout_s > 0, "must be > 0")


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    """Everything ``stateshift train`` reads."""

    executor: Literal["auto", "inprocess", "process", "ray"] = "auto"
    """where the rollouter runs: 'inprocess' on a thread of the trainer's process; 'process' in a process of its own
    (rollout.device); 'ray' the trainer, the rollouter and the queue as Ray actors in a placement group (the ray
    section; pip install 'stateshift[ray]'); 'auto': 'process' with run.device=cuda, else 'inprocess'"""
    task: TaskConfig = field(default_factory=TaskConfig)
    """the task"""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """the reward of task.name=file"""
    model: ModelConfig = field(default_factory=ModelConfig)
    """the policy model"""
    warmup: WarmupConfig = field(default_factory=WarmupConfig)
    """supervised warm-up"""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """the rollouter"""
    async_training: AsyncConfig = field(default_factory=AsyncConfig)
    """staleness control"""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """the trainer"""
    run: RunConfig = field(default_factory=RunConfig)
    """seeds, outputs, liveness"""
    ray: RayConfig = field(default_factory=RayConfig)
    """the Ray executor (read only with executor=ray)"""

    def __post_init__(self) -> None:
        if self.executor == "auto":
            self.executor = "process" if self.run.device == "cuda" else "inprocess"
        self._check_schedule()
        self._check_task()
        self._check_placement()

    def _check_task(self) -> None:
        """What each task needs from the model and the rollout."""
        _check(
            "rollout.max_new_tokens",
            self.task.name != "longtail" or self.rollout.max_new_tokens >= 7 * self.task.max_terms,
            f"must be >= 7 * task.max_terms ({7 * self.task.max_terms}) for the longtail task",
        )
        _check(
            "task.name",
            self.task.name != "longtail" or self.model.family in ("builtin", "hf"),
            "longtail runs on model.family builtin or hf in this version (megatron and fsdp2 size their positions "
            "for the addition task)",
        )
        _check(
            "run.checkpoint_every",
            self.task.name != "longtail" or self.run.checkpoint_every == 0,
            "must be 0 with task.name=longtail in this version (its items are not in the checkpoint format yet)",
        )
        _check(
            "rollout.batching",
            self.rollout.batching == "wave"
            or (
                self.executor in ("inprocess", "process")
                and self.model.family == "builtin"
                and self.run.checkpoint_every == 0
            ),
            "continuous needs executor=inprocess or process, model.family=builtin and run.checkpoint_every=0 in "
            "this version",
        )
        _check(
            "rollout.max_new_tokens",
            self.model.family != "builtin" or self.task.name != "addition" or self.rollout.max_new_tokens <= 8,
            "must be <= 8 for the built-in model (16 positions, 8 of them the prompt)",
        )
        if self.task.name == "file":
            _check(
                "task.tokenizer_path",
                bool(self.task.tokenizer_path or self.model.hf_path),
                "task.name=file needs a tokenizer: set model.hf_path or task.tokenizer_path",
            )
            _check(
                "model.family",
                self.model.family != "megatron",
                "task.name=file runs the builtin, hf and fsdp2 families (no Hugging Face to Megatron conversion)",
            )

    def _check_schedule(self) -> None:
        """Checkpoints at syncs; a sync-mode queue that holds a version."""
        every, trigger = self.run.checkpoint_every, self.async_training.trigger_parameter_sync_step
        _check(
            "run.checkpoint_every",
            every % trigger == 0,
            f"must be a multiple of async_training.trigger_parameter_sync_step ({trigger}): checkpoints are taken at syncs",
        )
        a, per_version = self.async_training, self.trainer.batch_prompts * self.async_training.require_batches * trigger
        _check(
            "async_training.max_queue_size",
            a.mode == "async" or a.max_queue_size is None or a.max_queue_size >= per_version,
            f"must hold a version's groups in sync mode ({per_version}) or be null",
        )

    def _check_placement(self) -> None:
        """Where the rollouter runs and what that needs."""
        rdev = self.rollout.device
        _check(
            "rollout.device",
            rdev is None or self.executor == "process" or rdev == self.run.device,
            "is read with executor=process only (the other executors compute where run.device says)",
        )
        _check(
            "rollout.device",
            rdev is None or rdev.split(":")[0] == self.run.device,
            f"must be on run.device's kind ({self.run.device}): trainer and rollouter exchange weights in host memory",
        )
        _check(
            "executor",
            self.executor != "ray" or importlib.util.find_spec("ray") is not None,
            "executor=ray needs Ray, which is not installed here: pip install 'stateshift[ray]'",
        )
        _check(
            "ray.num_cpus",
            self.ray.num_cpus is None or self.ray.num_cpus >= self.ray.trainer_cpus + self.ray.rollout_cpus,
            f"must hold ray.trainer_cpus + ray.rollout_cpus ({self.ray.trainer_cpus + self.ray.rollout_cpus:g})",
        )


# --------------------------------------------------------------------------- from dicts, YAML, overrides


def _coerce(key: str, value: Any, hint: Any) -> Any:
    """``value`` as the annotated type ``hint``, or ``ConfigError`` naming ``key``."""
    origin = typing.get_origin(hint)
    if origin is Literal:
        if value not in typing.get_args(hint):
            raise ConfigError("config", f"must be one of {list(typing.get_args(hint))}, not {show(value)}", key=key)
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        if value is None or (isinstance(value, str) and value.lower() in ("null", "none")):
            _check(key, type(None) in args, "may not be null")
            return None
        return _coerce(key, value, next(a for a in args if a is not type(None)))
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError("config", f"must be true or false, not {show(value)}", key=key)
        return value
    if hint is int:
        if not isinstance(value, int) or isinstance(value, bool):
            raise ConfigError("config", f"must be an integer, not {show(value)}", key=key)
        return value
    if hint is float:
        return _finite(key, value)
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError("config", f"must be a string, not {show(value)}", key=key)
        return value
    raise ConfigError(
        "config", f"unsupported type {hint!r}", key=key
    )  # pragma: no cover - every field is one of the above


def _finite(key: str, value: Any) -> float:
    """``value`` (a number, or a string holding one) as a finite float, or ``ConfigError`` naming ``key``."""
    number: Any = value
    if isinstance(value, str) and len(value) <= 100:
        try:
            number = float(value)
        except ValueError:
            pass
    if not isinstance(number, (int, float)) or isinstance(number, bool):
        raise ConfigError("config", f"must be a number, not {show(value)}", key=key)
    try:
        number = float(number)
    except OverflowError:
        raise ConfigError(
            "config", f"must be a finite number, not {show(value)} (too large for a float)", key=key
        ) from None
    if not math.isfinite(number):
        raise ConfigError("config", f"must be a finite number, not {number}", key=key)
    return number


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def build(cls: type, data: dict[str, Any], prefix: str = "") -> Any:
    """An instance of the config dataclass ``cls`` from nested dicts; unknown keys raise ``ConfigError``."""
    if not isinstance(data, dict):
        raise ConfigError("config", f"must be a mapping, not {show(data)}", key=prefix.rstrip(".") or "(root)")
    hints = _hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        dotted = f"{prefix}{key if isinstance(key, str) and len(key) <= 200 else show(key)}"
        if key not in names:
            raise ConfigError("config", f"unknown key (known here: {', '.join(sorted(names))})", key=dotted)
        hint = hints[key]
        if dataclasses.is_dataclass(hint):
            kwargs[key] = build(hint, value if value is not None else {}, f"{dotted}.")
        else:
            kwargs[key] = _coerce(dotted, value, hint)
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (TypeError, ValueError) as exc:
        raise ConfigError("config", str(exc), key=prefix.rstrip(".") or "(root)") from exc


def as_dict(cfg: Any) -> dict[str, Any]:
    """Nested plain dicts (what ``config.yaml`` holds)."""
    return {
        f.name: (as_dict(v) if dataclasses.is_dataclass(v := getattr(cfg, f.name)) else v)
        for f in dataclasses.fields(cfg)
    }


#: the largest config file read (a config is a few KB)
MAX_CONFIG_BYTES = 1 << 20


def _no_alias_loader() -> type:
    """A ``yaml.SafeLoader`` that refuses aliases: through them a few hundred bytes expand to billions of
    nodes (a "billion laughs"), and anything that walks the result -- a check, a repr -- walks them all."""
    import yaml

    class NoAliasLoader(yaml.SafeLoader):
        where = "YAML"

        def compose_node(self, parent: Any, index: Any) -> Any:
            if self.check_event(yaml.AliasEvent):
                event = self.peek_event()
                raise ConfigError(
                    "config",
                    f"{self.where}, line {event.start_mark.line + 1}: YAML aliases "
                    f"(*{show(event.anchor)}) are not allowed in a config; write the value out",
                    key="(root)",
                )
            return super().compose_node(parent, index)

    return NoAliasLoader


def load_yaml(text: str, where: str) -> Any:
    """``text`` parsed as YAML without aliases (``ConfigError`` for one, or for nesting too deep); ``where`` (a file
    name, an override) goes into the messages. Bounded in time and memory by the size of ``text``."""
    loader = _no_alias_loader()(text)
    loader.where = where
    try:
        return loader.get_single_data()
    except RecursionError:
        raise ConfigError("config", f"{where} is nested too deeply", key="(root)") from None
    finally:
        loader.dispose()


def _read_config(path: str | Path) -> Any:
    with Path(path).open("rb") as f:
        raw = f.read(MAX_CONFIG_BYTES + 1)
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError("config", f"{path} is larger than {MAX_CONFIG_BYTES} bytes: not a config file", key="(root)")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError("config", f"{path} is not UTF-8 text (byte {e.start})", key="(root)") from None
    return load_yaml(text, str(path))


def parse_override(text: str) -> tuple[list[str], Any]:
    """``a.b=value`` -> (["a", "b"], value parsed as YAML: numbers, true/false, null, strings)."""
    if "=" not in text:
        raise ConfigError("config", "an override is key=value (e.g. trainer.lr=1e-3)", key=text)
    key, _, raw = text.partition("=")
    path = key.strip().split(".")
    _check(key, all(path), "empty key")
    return path, load_yaml(raw, f"the override of {show(key)}") if raw.strip() else ""


def resolve(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> TrainConfig:
    """The config of a run: defaults, then the YAML file at ``path``, then each ``key=value`` override.

    Raises:
        ConfigError: a bad key or value (non-finite numbers included), a YAML alias, nesting too deep, a file over
            ``MAX_CONFIG_BYTES``; the message names the key and is bounded whatever the input.
        OSError: ``path`` cannot be read. ``yaml.YAMLError``: ``path`` is not YAML.
    """
    data: dict[str, Any] = {}
    if path is not None:
        loaded = _read_config(path)
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError("config", f"{path} must hold a mapping of sections", key="(root)")
        data = loaded or {}
    for text in overrides:
        keys, value = parse_override(text)
        node = data
        for k in keys[:-1]:
            child = node.setdefault(k, {})
            if not isinstance(child, dict):
                raise ConfigError("config", f"{show(k)} is a value, not a section", key=".".join(keys))
            node = child
        node[keys[-1]] = value
    return build(TrainConfig, data)


def save(cfg: TrainConfig, path: str | Path) -> None:
    import yaml

    Path(path).write_text(yaml.safe_dump(as_dict(cfg), sort_keys=False))


# --------------------------------------------------------------------------- documentation


def field_docs(cls: type = TrainConfig, prefix: str = "") -> list[tuple[str, Any, str]]:
    """(dotted key, default, docstring) of every leaf field, read from this module's source."""
    docs = _docstrings(cls)
    out: list[tuple[str, Any, str]] = []
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint):
            out += field_docs(hint, f"{prefix}{f.name}.")
        else:
            out.append((f"{prefix}{f.name}", f.default, docs.get(f.name, "")))
    return out


def _docstrings(cls: type) -> dict[str, str]:
    node = ast.parse(inspect.getsource(cls)).body[0]
    assert isinstance(node, ast.ClassDef)
    out: dict[str, str] = {}
    for stmt, nxt in zip(node.body, node.body[1:]):  # noqa: B905 - pairs of neighbours
        if (
            isinstance(stmt, ast.AnnAssign)
            and isinstance(stmt.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            out[stmt.target.id] = " ".join(nxt.value.value.split())
    return out
