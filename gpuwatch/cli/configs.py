"""From parsed flags to the typed configs the layers below take (`runtime.SessionConfig`,
`workload.factory.WorkloadSpec`), and a resumed run's flags from the ones it recorded. Checks that need
more than one flag, or the machine (a busy port, a folder that cannot be written, a missing extra), are
made here, before anything is built or written."""

from __future__ import annotations

from gpuwatch.cli.output import status as say
from gpuwatch.cli.parser import build_parser, parse_recorded
from gpuwatch.errors import UsageError
from gpuwatch.extras import require

__all__ = ["RESUME_FIXED", "check_prometheus", "resumed_args", "session_config", "workload_spec"]


def session_config(args, workload: bool, deliver_s: float = 0.0):
    from gpuwatch.control.policy import GuardConfig
    from gpuwatch.runtime import ModelChoice, SessionConfig

    spec = workload_spec(args) if workload else None
    guard = GuardConfig(mode=getattr(args, "guard", "off"), rule=getattr(args, "guard_rule", "model"),
                        plan=getattr(args, "guard_plan", "on") == "on")
    out = args.output if args.record else None
    if args.prometheus is not None:
        check_prometheus(*args.prometheus)
    if out is not None:
        from gpuwatch.atomic import check_output_dir

        check_output_dir(out)
    return SessionConfig(interval_s=args.interval, record_dir=out, source=args.source,
                         gpus=getattr(args, "sample_gpus", None), sampler=args.sampler, deliver_s=deliver_s,
                         workload=spec, guard=guard, prometheus=args.prometheus,
                         model=ModelChoice(args.model, not args.no_model, args.trust_model, args.risk_threshold))


def check_prometheus(host: str, port: int) -> None:
    """The address is bound and released before anything is built or written (a busy port used to be
    found after the workload was built, leaving a session folder behind); one bound beyond loopback is
    said to be reachable from the network."""
    from gpuwatch.export.prometheus import PrometheusExporter
    from gpuwatch.telemetry.bus import Bus

    ex = PrometheusExporter(Bus(), [], host, port)
    ex.check()
    if ex.public:
        say(f"warning: --prometheus {host}:{port} serves the metrics on "
            f"{'every interface' if host in ('0.0.0.0', '::', '') else host}: anyone who can reach this "
            "host can read them (no authentication); give a port alone for 127.0.0.1 only")


def workload_spec(args):
    """The DeepSeek workload's spec; MissingExtra (one line, exit 2) where torch or transformers is not
    installed (the core install: `pip install 'gpuwatch[workload]'`), before anything is built."""
    require("the workload", "workload")
    from gpuwatch.workload.factory import WorkloadSpec
    from gpuwatch.workload.presets import parse_overrides, validate_overrides

    if args.new_tokens is not None and args.mode != "decode":
        raise UsageError(f"--new-tokens is for --mode decode (this run is --mode {args.mode})")
    return WorkloadSpec(
        preset=args.preset, mode=args.mode, schedule=args.schedule, precision=args.precision, batch=args.batch,
        seq_len=args.seq_len, max_batch=args.max_batch, device=args.device, gpus=args.gpus,
        memory_limit_bytes=args.gpu_memory_limit, leak_mib=args.leak_mib, fragment=args.fragment,
        fp16_overflow=args.fp16_overflow, integrity_every=args.integrity_every,
        overrides=validate_overrides(parse_overrides(args.set)), seed=args.seed, max_steps=getattr(args, "steps", None),
        graphs=args.graphs, new_tokens=args.new_tokens, tuning=tuple(getattr(args, "tune", ())))


# flags a resumed run takes from the recorded command line; given again, they must agree with it
RESUME_FIXED = ("preset", "mode", "schedule", "precision", "batch", "seq_len", "max_batch", "device", "gpus",
                "gpu_memory_limit", "leak_mib", "fragment", "fp16_overflow", "integrity_every", "set", "seed",
                "graphs", "tune", "guard", "guard_rule", "guard_plan", "interval", "sampler", "source")


def resumed_args(args, point):
    """The recorded `gpuwatch stress` flags of `point`'s session, with this command's run flags (duration,
    steps, progress, outputs, model) on top. A workload flag given here that differs from the recorded
    one is a UsageError; one left at its default takes the recorded value."""
    try:
        orig = parse_recorded(point.argv)
    except UsageError as e:
        raise UsageError(f"--resume {point.dir}: its recorded command line no longer parses ({e})") from None
    defaults = build_parser().parse_args(["stress"])
    first = point.meta["config"]["workloads"][0]
    orig.preset = orig.preset or first.get("preset")  # "largest that fits" was decided once, at the start
    orig.precision = orig.precision or first.get("precision")
    for f in RESUME_FIXED:
        new, was = getattr(args, f), getattr(orig, f)
        if new != getattr(defaults, f) and new != was:
            flag = "--" + f.replace("_", "-")
            raise UsageError(f"--resume {point.dir}: {flag} {new} contradicts the recorded run ({flag} {was})")
    for f in ("progress", "summary_json", "junit", "fail_on", "model", "no_model", "trust_model", "risk_threshold",
              "prometheus", "resume"):
        if hasattr(args, f):
            setattr(orig, f, getattr(args, f))
    orig.duration = args.duration if args.duration is not None else orig.duration
    orig.steps = args.steps if args.steps is not None else orig.steps
    orig.record, orig.output = True, point.dir.parent
    return orig
