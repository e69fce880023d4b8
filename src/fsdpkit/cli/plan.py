"""`fsdpkit plan`: will this training config fit on these nodes, how fast, and what to change."""

from __future__ import annotations

import argparse
import logging
import math
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fsdpkit.cli.output import Parser, emit_error, emit_json, show_notes
from fsdpkit.effects import Effect, declare
from fsdpkit.errors import UserError
from fsdpkit.plan.grace import DEFAULT_WRITE_MB_S, cadence, grace_period, startup, stop_tier
from fsdpkit.plan.memory import NF4_BYTES

if TYPE_CHECKING:  # imported when a verb runs, so that --help stays fast
    from fsdpkit.plan.planner import Plan
    from fsdpkit.train.config import TrainConfig

log = logging.getLogger(__name__)
GIB = 2**30
DEFAULT_MFU = 0.4


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="fsdpkit plan", description="Memory per GPU, communication per step, throughput, time and "
               "cost for a training config on an instance type, from the same config that runs the job. "
               "Trainer flags (fsdpkit train --help) may follow, e.g. --seq-len 8192 --activation-checkpointing full.")
    # The job spec, if any, comes first; it is taken apart from the parser because trainer flags
    # with values (--seq-len 4096) would otherwise be read as it.
    p.usage = "fsdpkit plan [JOBSPEC] [options] [trainer flags]"
    p.add_argument("--preset", help="model preset (without a job spec)")
    p.add_argument("--config", help="a training YAML (as `fsdpkit train --config`)")
    p.add_argument("--instance-type", help="p5.48xlarge, p4d.24xlarge, g6e.12xlarge, ... (default: the job spec's)")
    p.add_argument("--nodes", type=int, help="nodes (default: the job spec's, or 1)")
    p.add_argument("--mfu", type=float, default=DEFAULT_MFU,
                   help=f"model FLOPs utilisation to assume (default {DEFAULT_MFU})")
    p.add_argument("--tokens", type=float, help="token budget: report the steps, time (and cost) to train on it; "
                   "with a job spec, the same as --set train.tokens=N (the job trains exactly that)")
    p.add_argument("--price-per-hour", type=float, help="your price per node-hour (no price list is built in): the "
                   "hourly cost of the nodes, and with --tokens the budget's")
    p.add_argument("--currency", default="USD", help="the unit of --price-per-hour (default USD)")
    p.add_argument("--write-mb-per-s", type=float, help="checkpoint storage's write throughput, for the grace "
                   f"period a stopping job needs (default: the job spec's storage.write_mb_per_s, or "
                   f"{DEFAULT_WRITE_MB_S})")
    p.add_spec_overrides()
    p.add_argument("--json", action="store_true")
    declare(p, Effect.NONE)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    show_notes()
    parser = build_parser()
    try:
        jobspec = argv.pop(0) if argv and not argv[0].startswith("-") else None
        args, train_flags = parser.parse_known_args(argv)
        args.jobspec = jobspec
        return run(args, train_flags)
    except UserError as e:
        return emit_error(e, "--json" in argv)


@dataclass(frozen=True)
class Planned:
    """What the plan is of: the config, where it runs, and its storage (from a job spec, or flags)."""

    cfg: TrainConfig
    instance_type: str | None
    nodes: int
    procs: int | None
    write_rate: float
    keeps_checkpoints: bool     # a checkpoint directory: saves are part of the run's time
    plan: Plan | None = None    # the job's own, where it was planned at the asked MFU
    devices: dict[str, str] | None = None   # a Kubernetes job's: how its pods ask for GPUs and EFA


def run(args: argparse.Namespace, train_flags: list[str]) -> int:
    from fsdpkit.plan.planner import advice, plan_config
    from fsdpkit.plan.runtime import run_time
    from fsdpkit.train.config import budget_steps, step_tokens

    for name in ("tokens", "price_per_hour", "write_mb_per_s"):
        if (value := getattr(args, name)) is not None and value <= 0:
            raise UserError(f"{name}: {value} is out of range (> 0)")
    got = _from_spec(args, train_flags) if args.jobspec else _from_flags(args, train_flags)
    cfg, nodes, write_rate = got.cfg, got.nodes, got.write_rate
    p = got.plan or plan_config(cfg, got.instance_type, nodes, args.mfu, got.procs)
    data_ranks = cfg.parallel.data_ranks(p.workload.world)
    per_step = step_tokens(cfg.data, data_ranks)
    # A spec's budget is already its steps (train.tokens); flags' --tokens is shared over the plan's ranks.
    steps = budget_steps(int(args.tokens), cfg.data, data_ranks) if args.tokens and not args.jobspec else \
        cfg.optim.max_steps
    out = {"model": cfg.preset, "verdict": advice(p), **p.summary(args.price_per_hour),
           "currency": args.currency, "recipe": _recipe(cfg), "objective": _objective(cfg),
           "adapters": _adapters(cfg),
           "validation": {"batches": cfg.log.validation_batches, "batch_size": cfg.data.val_batch_size,
                          "every_steps": cfg.log.validation_freq, "share": round(cfg.validation_share(steps), 4)},
           **_stop_and_start(got, p.step_s), "alternatives": [a.summary(args.price_per_hour) for a in p.alternatives]}
    if got.devices:
        out["devices"] = got.devices
    if p.step_s is not None:
        rt = run_time(cfg, steps, per_step, p.step_s, write_rate if got.keeps_checkpoints else None, nodes)
        out["run"] = rt.to_dict()
        if args.tokens or args.jobspec:   # a budget, or the job as its spec runs it
            out["hours"] = round(rt.total_s / 3600, 2)
            out["cost"] = round(rt.total_s / 3600 * nodes * args.price_per_hour, 2) if args.price_per_hour else None
    # A plan that does not fit is a check that failed: exit 1, with what to change as the hint.
    code = 1 if p.fits is False else 0
    if args.json:
        best = next((a for a in out["alternatives"] if a["fits"]), None)
        return emit_json(out, code, out["verdict"], hint=f"plan again with {best['change']}" if best else None)
    _print(out)
    return code


def _stop_and_start(got: Planned, step_s: float | None) -> dict[str, Any]:
    """The grace a stopping pod needs to write its checkpoint, the start-up, and the checkpoints'
    cadence (the derived one, or what the run was given beside it)."""
    cfg, write_rate = got.cfg, got.write_rate
    stop_rate, stop_to = stop_tier(cfg.checkpoint.tiered, write_rate, got.nodes)
    lora = cfg.lora_shape   # a LoRA run saves its adapters alone
    grace = grace_period(cfg.shape, stop_rate, step_s, stop_to, lora)
    start = startup(cfg.shape, write_rate, cfg.parallel.compiles("cuda" if got.instance_type else "cpu"), lora,
                    cfg.shape if cfg.checkpoint.init_from_hf else None)
    derived, every = cadence(cfg.shape, write_rate, lora), cfg.checkpoint.checkpoint_every
    checkpoints = derived.to_dict() if every in ("0", derived.every) else {
        "every": every, "explanation": f"every {every}{' steps' if every.isdigit() else ''}, as configured (the "
        f"derived default: every {derived.every})"}
    return {"grace": grace.to_dict(), "startup": start.to_dict(), "checkpoints": checkpoints}


def _from_spec(args: argparse.Namespace, train_flags: list[str]) -> Planned:
    """The job the spec resolves to, with --instance-type, --nodes, --write-mb-per-s and --tokens
    applied to the spec itself, so the plan is of the job that would run."""
    from fsdpkit.jobs.resolved import resolve, with_budget
    from fsdpkit.jobs.spec import load_spec, parse_overrides

    if train_flags or args.preset or args.config:
        raise UserError("with a job spec, change its train options with --set train.KEY=VALUE")
    overrides = parse_overrides(args.set)
    for key, value in (("instance_type", args.instance_type), ("nodes", args.nodes),
                       ("storage.write_mb_per_s", args.write_mb_per_s)):
        if value is not None:
            overrides.append((key, int(value) if isinstance(value, float) and value.is_integer() else value))
    spec = load_spec(args.jobspec, overrides)
    if args.tokens is not None:
        tokens = math.ceil(args.tokens)
        spec, replaced = with_budget(spec, tokens)
        if replaced:
            log.info(f"note: --tokens {tokens:,} replaces the spec's {replaced}; to run this plan, set train.tokens: "
                     f"{tokens} in the spec and drop {replaced.split()[0]}")
    job = resolve(spec)
    t = job.trainer
    if t is None:
        raise UserError("jobspec: this job runs its own command, not fsdpkit's trainer; nothing to plan")
    if why := job.default_steps():
        log.warning(why)
    devices = next(({"mode": str(s.value), "explanation": s.why} for s in job.sources if s.name == "devices"), None)
    return Planned(t.config, spec.instance_type, spec.nodes.max, spec.procs if spec.instance_type else None,
                   spec.storage.write_mb_per_s, bool(job.root), t.plan if args.mfu == DEFAULT_MFU else None,
                   devices)


def _from_flags(args: argparse.Namespace, train_flags: list[str]) -> Planned:
    from fsdpkit.train.config import parse_args

    unknown = [f for f in train_flags if f.startswith("-")]
    flags = (["--preset", args.preset] if args.preset else []) + (["--config", args.config] if args.config else [])
    try:
        cfg = parse_args([*flags, *train_flags])
    except SystemExit:  # argparse inside the trainer's parser: a bad flag
        raise UserError(f"unknown or bad trainer option among: {' '.join(unknown)} (see fsdpkit train --help)") \
            from None
    return Planned(cfg, args.instance_type, args.nodes if args.nodes is not None else 1, None,
                   args.write_mb_per_s or DEFAULT_WRITE_MB_S, bool(cfg.checkpoint.checkpoint_dir))


def _recipe(cfg: TrainConfig) -> dict[str, Any]:
    from fsdpkit.train.config import recipe_source

    o = cfg.optim
    return {"source": recipe_source(cfg), "lr": o.lr, "min_lr": o.min_lr,
            "lr_decay_style": o.lr_decay_style, "warmup_steps": o.warmup_steps, "weight_decay": o.weight_decay,
            "betas": [o.beta1, o.beta2], "grad_clip": o.grad_clip, "tokenizer": cfg.data.tokenizer}


def _objective(cfg: TrainConfig) -> dict[str, Any]:
    """What the run minimises and, for DPO, what its reference costs (see plan.memory)."""
    loss = cfg.loss
    if loss.objective == "sft":
        return {"name": "sft"}
    reference = ("the base with its LoRA adapters off (no copy)" if cfg.lora_shape else
                 "a frozen copy of the model (its shards count in params)")
    return {"name": loss.objective, "loss": loss.dpo_loss, "beta": loss.dpo_beta, "reference": reference,
            "explanation": f"{loss.objective} ({loss.dpo_loss}, beta {loss.dpo_beta:g}) against {reference}; the "
                           "reference's forward adds a third to each step's compute"}


def _adapters(cfg: TrainConfig) -> dict[str, Any] | None:
    """The LoRA adapters a run trains and how its frozen base is stored (see plan.memory), or None."""
    lora = cfg.lora_shape
    if lora is None:
        return None
    base = (f"projections in nf4 ({NF4_BYTES:.3f} bytes a parameter), the rest fp32" if lora.nf4
            else "fp32 (4 bytes a parameter)")
    return {"rank": lora.rank, "alpha": lora.alpha, "targets": list(lora.targets), "base_dtype": lora.base_dtype,
            "explanation": f"LoRA rank {lora.rank} on {','.join(lora.targets)}; the frozen base: {base}"}


def _print(out: dict[str, Any]) -> None:
    where = f"{out['nodes']} x {out['instance_type']} ({out['world']} ranks)" if out["instance_type"] else \
        f"{out['world']} rank(s), no instance type"
    print(f"{out['model']} on {where}: seq {out['seq_len']} x micro-batch {out['micro_batch']} x accumulation "
          f"{out['grad_accum']}, {out['dtype']}, sharding {out['sharding']}, activation checkpointing "
          f"{out['activation_checkpointing']}{', CPU offload' if out['cpu_offload'] else ''}"
          f"{f', context parallel {cp}' if (cp := out['context_parallel']) > 1 else ''}"
          f"{f', expert parallel {ep}' if (ep := out['expert_parallel']) > 1 else ''}")
    _print_memory(out)
    _print_time(out)
    _print_run(out)
    print(f"\n{out['verdict']}")
    for a in out["alternatives"]:
        print(f"  with {a['change']}: {'fits' if a['fits'] else 'does not fit'}, {a['peak_gib']:.1f} GiB per GPU, "
              f"{a['nodes']} node(s), about {a['tokens_per_s'] or 0:,} tokens/s")


def _print_memory(out: dict[str, Any]) -> None:
    """Memory per rank, term by term, and the peak with the moment it falls at."""
    m = out["memory_gib"]
    # Each term at its largest; activations are freed as backward makes gradients, so no moment holds
    # every row and they may add up to more than the peak, which is the largest moment's sum.
    print("\nmemory per rank (GiB; each term at its largest, not all held at once)")
    for k in ("params", "grads", "optimizer", "fsdp_buffers", "activations", "loss", "backward_working"):
        print(f"  {k:18s} {m[k]:10.2f}")
    usable = f" of {out['usable_gib']:.2f} usable" if out["usable_gib"] else ""
    print(f"  {'peak':18s} {out['peak_gib']:10.2f}{usable}  (at {out['peak_at']}; the largest of: start of backward "
          f"{m['backward_start']:.2f}, end of backward {m['backward_end']:.2f}, validation {m['validation']:.2f})")
    if m["host"]:
        print(f"  {'host (offload)':18s} {m['host']:10.2f}")


def _print_time(out: dict[str, Any]) -> None:
    """What a step moves and costs, and the run's time and price."""
    c = out["comm_bytes"]
    print(f"\ncommunication per step and rank: all-gather {c['all_gather_bytes'] / GIB:.2f} GiB "
          f"({c['all_gathers']} calls), reduce-scatter {c['reduce_scatter_bytes'] / GIB:.2f} GiB "
          f"({c['reduce_scatters']} calls), on the wire {c['wire_bytes'] / GIB:.2f} GiB")
    if c["all_to_alls"]:
        print(f"{'context' if out['context_parallel'] > 1 else 'expert'} parallel: all-to-all "
              f"{c['all_to_all_bytes'] / GIB:.2f} GiB ({c['all_to_alls']} calls), "
              f"{c['all_to_all_wire_bytes'] / GIB:.2f} GiB of it to other ranks")
    if out["compute_s"] is not None:
        context = f" + all-to-all {out['all_to_all_s']:.3f} s" if out["all_to_all_s"] is not None else ""
        print(f"step: compute {out['compute_s']:.3f} s at {out['mfu']:.0%} MFU{context}, communication "
              f"{out['comm_s']:.3f} s -> {out['bound']}-bound, about {out['tokens_per_s']:,} tokens/s")
    if out.get("cost_per_hour") is not None:
        print(f"cost: {out['cost_per_hour']:,.2f} {out['currency']} per hour for {out['nodes']} node(s) at your price")
    if out.get("run"):
        cost = f", {out['cost']:,.2f} {out['currency']} at your price" if out.get("cost") is not None else ""
        print(f"run: {out['run']['explanation']}{cost}")


def _print_run(out: dict[str, Any]) -> None:
    """The recipe, validation, adapters, objective, checkpoints, devices, stop and start."""
    r, v = out["recipe"], out["validation"]
    schedule = "constant" if r["lr_decay_style"] == "constant" else f"-> {r['min_lr']:g} ({r['lr_decay_style']})"
    print(f"\nrecipe: lr {r['lr']:g} {schedule}, warm-up {r['warmup_steps']} steps, "
          f"weight decay {r['weight_decay']:g}, betas ({r['betas'][0]:g}, {r['betas'][1]:g}), clip "
          f"{r['grad_clip']:g}, tokenizer {r['tokenizer']}  [{r['source']}]")
    every = f"every {v['every_steps']} steps and at the end" if v["every_steps"] else "at the end"
    print(f"validation: {v['batches']} batch(es) of {v['batch_size']} {every}: {v['share']:.1%} of training compute")
    if out["adapters"]:
        print(f"adapters: {out['adapters']['explanation']}")
    if "explanation" in out["objective"]:
        print(f"objective: {out['objective']['explanation']}")
    print(f"checkpoints: {out['checkpoints']['explanation']}")
    if "devices" in out:
        mode = "DRA claims" if out["devices"]["mode"] == "dra" else "extended resources"
        print(f"devices: {mode} ({out['devices']['explanation']})")
    print(f"stopping: grace period {out['grace']['explanation']}")
    print(f"starting: {out['startup']['explanation']} (HyperPod's startup deadline; with the grace, its fault "
          "deadline)")
