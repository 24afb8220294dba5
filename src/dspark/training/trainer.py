"""The training loop: AdamW, warmup + cosine, gradient accumulation, clipping, exact resume, torchrun (gloo).

Exactness across process counts: step s always takes the same `batch_seqs` sequences (a per-epoch permutation),
split into `grad_accum` micro-batches, each split contiguously over the processes; anchors are drawn per
(seed, epoch, sequence). The loss of every micro-batch is divided by the denominator of the WHOLE step (known
from the plans before any forward, all-reduced), and gradients are summed over processes. So 1 process with
accumulation a·W and W processes with accumulation a compute the same micro-batches and the same sums.
Resume: the data position is a function of the step, and the optimizer, weights and RNG are in the checkpoint.
"""
from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from ..drafters.dspark_checkpoint import save_drafter
from ..drafters.dspark_model import DrafterArch, DSparkModel, default_layer_ids
from ..drafters.eagle3_model import Eagle3Model
from . import eagle3_losses
from .checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from .config import ConfigError, TrainConfig
from .losses import STAT_KEYS, backward, slot_weights, tau_estimate
from .packing import load_batch, plan_batch
from .train_log import CsvLog, StepProfiler, progress_bar

FIT_AFTER_STEPS = 10  # timed steps before fit_steps_to_time decides


def init_distributed() -> tuple[int, int]:
    """(rank, world size); joins the torchrun group (gloo: CPU) when launched by torchrun."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        dist.init_process_group("gloo")
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


@dataclass(frozen=True)
class Recipe:
    """What a drafter type changes in training; everything else (steps, accumulation, resume) is shared."""

    model: Callable  # (arch, target) -> the network
    plan: Callable  # packing.plan_batch's signature
    load: Callable  # packing.load_batch's signature
    weights: Callable  # (block_size, LossSection) -> [γ] slot weights
    alpha: Callable  # LossSection -> (ce, tv, conf, soft) coefficients of the logged loss
    backward: Callable  # losses.backward's signature


_DSPARK = Recipe(DSparkModel, plan_batch, load_batch, lambda block, loss: slot_weights(block, loss.decay),
                 lambda loss: (loss.ce, loss.tv, loss.conf, loss.soft), backward)
# EAGLE-3 baseline: TTT over the chain; "ce" is its soft cross-entropy −Σ p log q, the whole loss.
_EAGLE3 = Recipe(Eagle3Model, eagle3_losses.plan_batch, eagle3_losses.load_batch,
                 lambda block, loss: eagle3_losses.step_weights(block), lambda loss: (1.0, 0.0, 0.0, 0.0),
                 eagle3_losses.backward)
RECIPES = {"dspark": _DSPARK, "dflash": _DSPARK, "eagle3": _EAGLE3}


def make_arch(cfg: TrainConfig, target) -> DrafterArch:
    c, tc = cfg.drafter, target.config
    plain = c.type in ("dflash", "eagle3")  # no sequential or confidence head
    return DrafterArch(drafter_type=c.type, layer_ids=tuple(c.layer_ids) or default_layer_ids(
        tc.num_layers, c.num_feature_layers), num_layers=c.num_layers, block_size=c.block_size,
        mask_token_id=c.mask_token_id if c.mask_token_id >= 0 else tc.vocab_size - 1,
        head="none" if plain else c.head, rank=0 if plain or c.head == "none" else c.rank,
        confidence=c.confidence and not plain, intermediate_size=c.intermediate_size, draft_vocab=c.draft_vocab)


def make_source(cfg: TrainConfig, loaded, layer_ids):
    from .features import OnlineFeatures, load_sequences
    from .target_cache import CachedFeatures

    if cfg.data.cache:
        return CachedFeatures(cfg.data.cache, layer_ids, target=loaded.model, limit=cfg.data.limit)
    if not cfg.data.dataset:
        raise ValueError("set data.dataset (datagen output) or data.cache (a built target cache)")
    data = load_sequences(cfg.data.dataset, loaded.tokenizer, cfg.data.max_seq_len, cfg.data.limit)
    return OnlineFeatures(loaded.model, data, layer_ids, cfg.data.feature_dtype)


class Trainer:
    def __init__(self, cfg: TrainConfig, loaded=None, source=None):
        self.cfg = cfg
        self.rank, self.world = init_distributed()
        if cfg.run.threads:
            torch.set_num_threads(cfg.run.threads)
        if loaded is None:
            from ..models import load_model
            loaded = load_model(cfg.target.name, cfg.target.dtype, cfg.target.device)
        self.loaded, self.target = loaded, loaded.model
        self.device = self.target.device
        if self.world > 1 and self.device.type != "cpu":
            raise ValueError("multi-process training runs on CPU (gloo); on a GPU use one process")
        arch = make_arch(cfg, self.target)
        self.source = source if source is not None else make_source(cfg, loaded, arch.layer_ids)
        torch.manual_seed(cfg.run.seed)  # the same initial weights in every process
        self.recipe = RECIPES[cfg.drafter.type]
        self.model = self.recipe.model(arch, self.target)
        if cfg.run.init_from:
            self.vocab_coverage = self._warm_start(cfg.run.init_from)
        else:
            if cfg.drafter.init_from_target:
                self.model.init_from_target(self.target)
            self.vocab_coverage = self._choose_draft_vocab()
        self.model.set_head_dtype(getattr(torch, cfg.optim.head_dtype))
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        o = cfg.optim
        self.optimizer = torch.optim.AdamW(self.params, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                                           weight_decay=o.weight_decay)
        self.micro = o.batch_seqs // o.grad_accum
        if self.micro % self.world:
            raise ValueError(f"batch_seqs/grad_accum = {self.micro} sequences per micro-batch cannot be split "
                             f"over {self.world} processes")
        self.steps_per_epoch = len(self.source) // o.batch_seqs
        if self.steps_per_epoch < 1:
            raise ValueError(f"the dataset has {len(self.source)} usable sequences, fewer than one batch "
                             f"({o.batch_seqs})")
        self.out = Path(cfg.run.out_dir)
        self.step, self.totals = 0, {"context_tokens": 0, "slots": 0, "seconds": 0.0}
        self.max_steps = o.max_steps  # fit_steps_to_time may shorten it once; checkpoints keep the fitted value
        if cfg.run.resume:
            self._resume()

    def _choose_draft_vocab(self) -> float | None:
        """Fill the draft vocabulary from the training data (deterministic; a resumed run reloads the same ids
        from its checkpoint). -> the fraction of answer tokens it covers, or None without one."""
        size = self.model.arch.draft_vocab
        if not size:
            return None
        from .draft_vocab import coverage, select_draft_vocab

        ids = select_draft_vocab(self.source.data, size, self.target.config.vocab_size,
                                 always=tuple(getattr(self.loaded, "eos_ids", ()) or ()))
        self.model.set_draft_vocab(ids)
        return coverage(self.source.data, ids)

    def _warm_start(self, path: str) -> float | None:
        """Load an exported drafter's weights (and draft vocabulary) into the fresh model. -> the fraction of
        answer tokens its draft vocabulary covers in this data, or None without one."""
        from ..drafters.dspark_checkpoint import load_drafter_model

        saved, _ = load_drafter_model(path, self.target, model_cls=self.recipe.model)
        if saved.arch != self.model.arch:
            a, b = saved.arch.__dict__, self.model.arch.__dict__
            diff = ", ".join(f"{k}: {a[k]!r} there, {b[k]!r} here" for k in a if a[k] != b.get(k))
            raise ConfigError(f"run.init_from = {path} is another architecture ({diff}); match the [drafter] "
                              f"section to it")
        self.model.load_state_dict(saved.state_dict())
        ids = self.model.vocab_ids
        if ids is None:
            return None
        from .draft_vocab import coverage

        return coverage(self.source.data, ids.cpu())

    # ------------------------------------------------------------------------------------------------
    def lr_at(self, step: int) -> float:
        o = self.cfg.optim
        if step < o.warmup_steps:
            return o.lr * (step + 1) / o.warmup_steps
        progress = min(1.0, (step - o.warmup_steps) / max(1, self.max_steps - o.warmup_steps))
        return o.lr * (o.min_lr_ratio + (1 - o.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))

    def step_sequences(self, step: int) -> tuple[int, list[int]]:
        """(epoch, the batch_seqs sequence indices of this optimizer step)."""
        epoch, offset = divmod(step, self.steps_per_epoch)
        g = torch.Generator().manual_seed(self.cfg.run.seed * 7919 + epoch)
        order = torch.randperm(len(self.source), generator=g)
        b = self.cfg.optim.batch_seqs
        return epoch, order[offset * b: (offset + 1) * b].tolist()

    def my_micro_batches(self, step: int) -> tuple[int, list[list[int]]]:
        epoch, seqs = self.step_sequences(step)
        share = self.micro // self.world
        micro = [seqs[j * self.micro: (j + 1) * self.micro] for j in range(self.cfg.optim.grad_accum)]
        return epoch, [m[self.rank * share: (self.rank + 1) * share] for m in micro]

    def _all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        if self.world > 1:
            dist.all_reduce(t)
        return t

    def train_step(self) -> dict:
        cfg, block = self.cfg, self.model.arch.block_size
        epoch, micro = self.my_micro_batches(self.step)
        recipe = self.recipe
        plans = [recipe.plan(self.source, m, epoch, cfg.run.seed, cfg.data.anchors_per_seq, block) for m in micro]
        weights = recipe.weights(block, cfg.loss)
        # fp64 sums of fp32 weights are exact, so the denominator is bitwise the same however it is split.
        den = sum(float((p.slot_valid.double() * weights.double()).sum()) for ps in plans for p in ps)
        den_total = float(self._all_reduce(torch.tensor([den], dtype=torch.float64))[0])
        alpha = recipe.alpha(cfg.loss)
        sums = torch.zeros(6 + 2 * block + 2, dtype=torch.float64)
        # Per-micro-batch gradients are summed in their own buffer, so the sum associates the same way as the
        # all-reduce over processes (bitwise-equal results when each process holds one micro-batch).
        acc = torch.zeros(sum(p.numel() for p in self.params), device=self.device)
        for ps in plans:
            if not ps:
                continue
            batch = recipe.load(self.source, ps, block, self.model.arch.mask_token_id).to(self.device)
            s = recipe.backward(self.model, batch, den_total, alpha, cfg.loss.decay, cfg.optim.loss_chunk_blocks)
            sums += torch.cat([torch.tensor([s[k] for k in STAT_KEYS], dtype=torch.float64),
                               s["accept"].double(), s["count"].double(),
                               torch.tensor([batch.features.shape[0], int(batch.block_valid.sum())],
                                            dtype=torch.float64)])
            acc += torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten()
                              for p in self.params])
            self.optimizer.zero_grad(set_to_none=True)
        flat, at = self._all_reduce(acc), 0
        for p in self.params:
            p.grad = flat[at: at + p.numel()].view_as(p).clone()
            at += p.numel()
        norm = float(torch.nn.utils.clip_grad_norm_(self.params, cfg.optim.clip or float("inf")))
        lr = self.lr_at(self.step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        stats = self._stats(self._all_reduce(sums), block, lr, norm, epoch)
        stats["loss"] = sum(a * stats[k] for a, k in zip(alpha, ("ce", "tv", "conf", "soft")))
        return stats

    @staticmethod
    def _stats(s: torch.Tensor, block: int, lr: float, norm: float, epoch: int) -> dict:
        den = max(float(s[4]), 1e-12)
        accept, count = s[6:6 + block], s[6 + block:6 + 2 * block]
        out = {"epoch": epoch, "lr": lr, "grad_norm": norm, "ce": float(s[0]) / den, "tv": float(s[1]) / den,
               "conf": float(s[2]) / den, "soft": float(s[3]) / den, "top1": float(s[5]) / max(float(count.sum()), 1),
               "tau_est": tau_estimate(accept, count), "context_tokens": int(s[-2]), "blocks": int(s[-1]),
               "slots": int(count.sum())}
        out.update({f"acc{k + 1}": float(a / max(float(c), 1)) for k, (a, c) in enumerate(zip(accept, count))})
        return out

    # ------------------------------------------------------------------------------------------------
    def _resume(self) -> None:
        path = latest_checkpoint(self.out)
        if path is None:
            return
        state = load_checkpoint(path, self.model, self.optimizer)
        if state["config"]["drafter"] != self.cfg.to_dict()["drafter"]:
            raise ValueError(f"{path} was trained with another [drafter] section; use a new run.out_dir")
        self.step, self.totals = state["step"], dict(state["extra"].get("totals", self.totals))
        fit = state["extra"].get("fit")  # kept only while optim.max_steps is the one that was fitted
        if fit and fit["from"] == self.cfg.optim.max_steps:
            self.max_steps = int(fit["to"])

    def save(self) -> Path | None:
        if self.rank == 0:
            tok = self.loaded.tokenizer
            return save_checkpoint(self.out, self.step, self.model, self.target, self.optimizer,
                                   config=self.cfg.to_dict(), target_name=self.cfg.target.name,
                                   chat_template=getattr(tok, "chat_template", None),
                                   extra={"totals": self.totals, "fit": self._fit_record()},
                                   keep=self.cfg.run.keep_checkpoints)
        return None

    def export(self) -> Path:
        dtype = getattr(torch, self.cfg.run.export_dtype)
        return save_drafter(self.out / "drafter", self.model, self.target, target_name=self.cfg.target.name,
                            chat_template=getattr(self.loaded.tokenizer, "chat_template", None), dtype=dtype,
                            training={"steps": self.step, "fit": self._fit_record(), **self.totals,
                                      "config": self.cfg.to_dict(),
                                      "draft_vocab_coverage": self.vocab_coverage})

    def run(self) -> dict:
        cfg, t_start = self.cfg, time.perf_counter()
        log = CsvLog(self.out / "train_log.csv", self.step) if self.rank == 0 else None
        bar = progress_bar(self.max_steps, self.step, cfg.run.progress and self.rank == 0)
        stats: dict = {}
        timed_out, ran, t_first, profiler = False, 0, 0.0, None
        try:
            while self.step < self.max_steps:
                t0 = time.perf_counter()
                if ran == FIT_AFTER_STEPS and cfg.run.profile_steps > 0 and self.rank == 0:
                    profiler = StepProfiler(self.device, cfg.run.profile_steps, self.out / "profile.txt")
                stats = self.train_step()
                if profiler is not None and profiler.stepped(self.step):
                    profiler = None
                dt = time.perf_counter() - t0
                self.totals["context_tokens"] += stats["context_tokens"]
                self.totals["slots"] += stats["slots"]
                self.totals["seconds"] += dt
                stats = {"step": self.step, **stats, "step_s": dt, "tokens_per_s": stats["context_tokens"] / dt,
                         "slots_per_s": stats["slots"] / dt, "elapsed_s": self.totals["seconds"]}
                bar.update(1)
                bar.set_postfix(loss=f"{stats['loss']:.3f}", tau=f"{stats['tau_est']:.2f}",
                                tok_s=f"{stats['tokens_per_s']:.0f}")
                if log is not None and self.step % cfg.run.log_every == 0:
                    log.write(stats)
                if self.step % cfg.run.ckpt_every == 0 or self.step == self.max_steps:
                    self.save()
                ran += 1
                if ran == 1:
                    t_first = time.perf_counter()  # the first step pays for warm-up: timed from its end
                elif ran == FIT_AFTER_STEPS and cfg.run.fit_steps_to_time and cfg.run.max_time_s > 0:
                    self._fit_steps(t_start, (time.perf_counter() - t_first) / (ran - 1))
                    bar.total = self.max_steps
                if self._out_of_time(t_start):
                    self.save()
                    timed_out = True
                    break
        finally:
            bar.close()
            if log is not None:
                log.close()
            if profiler is not None:
                profiler.stop(self.step)
        done = self.step >= self.max_steps or (timed_out and cfg.run.export_on_stop)
        exported = self.export() if self.rank == 0 and done else None
        return {"step": self.step, "drafter": str(exported) if exported else None, "last": stats, **self.totals}

    def _fit_steps(self, t_start: float, step_s: float) -> None:
        """Shorten the schedule to the steps that fit the time box: `step_s` is a loop iteration's mean wall
        time after the first (logging and checkpoints included), averaged over processes; a 10 % margin (the first
        GPU run's 5 % left it 13 steps short of its fitted 542: later steps ran slower than the first ten)."""
        step_s = float(self._all_reduce(torch.tensor([step_s], dtype=torch.float64))[0]) / self.world
        left = self.cfg.run.max_time_s - (time.perf_counter() - t_start)
        fits = self.step + int(0.9 * left / step_s)
        if fits < self.max_steps:
            self.max_steps = max(self.step + 1, fits)
            if self.rank == 0:
                print(f"train: {step_s * 1e3:.0f} ms a step, so {self.max_steps} steps fit max_time_s = "
                      f"{self.cfg.run.max_time_s:g} s (was optim.max_steps = {self.cfg.optim.max_steps})",
                      file=sys.stderr, flush=True)

    def _fit_record(self) -> dict | None:
        o = self.cfg.optim.max_steps
        return {"from": o, "to": self.max_steps} if self.max_steps != o else None

    def _out_of_time(self, t_start: float) -> bool:
        limit = self.cfg.run.max_time_s
        stop = torch.tensor([float(limit > 0 and time.perf_counter() - t_start > limit)])
        return bool(self._all_reduce(stop)[0] > 0)  # all processes stop at the same step
