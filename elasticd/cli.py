"""The ``elasticd`` command line: run the daemon, show status, drain a node, demo."""

from __future__ import annotations

import json
import sys
import time

import click

from elasticd.errors import ConfigError, ElasticdError


def _load(path: str):
    from elasticd.config import load_config

    try:
        return load_config(path)
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from None


@click.group()
@click.version_option(package_name="elasticd")
def main() -> None:
    """elasticd: keeps torchrun elastic training alive on preemptible nodes."""


@main.command(context_settings={"ignore_unknown_options": True, "help_option_names": []})
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def chaos(args: tuple[str, ...]) -> None:
    """Run a chaos scenario on a local cluster (``elasticd chaos --help``)."""
    from elasticd.lab.chaos.__main__ import main as chaos_main

    sys.exit(chaos_main(list(args), prog="elasticd chaos"))


@main.command()
@click.option("--config", "config_path", required=True, type=click.Path(dir_okay=False),
              help="TOML config file (see deploy/config/).")
@click.option("--log-level", default="info", show_default=True)
def run(config_path: str, log_level: str) -> None:
    """Run the node daemon until the job completes or the node is drained."""
    from elasticd.config import check_secret_file
    from elasticd.logs import configure_logging
    from elasticd.prestart import prepare

    configure_logging(log_level)
    config = _load(config_path)
    _refuse_a_bad_checkpoint_dir(config)
    try:
        check_secret_file(config.recovery)   # before the warm server: a refusal leaves nothing
        early = prepare(config)              # checks [job] worker_user
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from None
    # The warm-start server first: its imports (torch among them) then run beside the
    # daemon's, not after them; a newcomer's workers wait for it (elasticd.prestart).
    early.start_warm(config)
    from elasticd.daemon import Daemon

    try:
        code = Daemon(config, config_path=config_path, early=early).run()
    except ElasticdError as exc:
        raise click.ClickException(str(exc)) from None
    sys.exit(code)


def _refuse_a_bad_checkpoint_dir(config) -> None:  # noqa: ANN001 - a loaded Config
    """What ``elasticd doctor`` finds wrong with the checkpoint directory stops ``run`` at
    once (exit 1; under systemd it retries, so a mount that comes up late is waited for)."""
    from elasticd.ops.doctor import checkpoint_dir_failures

    failures = checkpoint_dir_failures(config)
    if failures:
        raise click.ClickException("cannot run: " + "; ".join(
            f"{c.what} (fix: {c.fix})" for c in failures))


@main.command()
@click.option("--config", "config_path", required=True, type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--events", default=10, show_default=True, help="How many recent events to show.")
def status(config_path: str, as_json: bool, events: int) -> None:
    """Job state, nodes, world size and round, newest checkpoint, recent events.

    \b
    Exit status:
      0  the job is running or completed
      1  a config or etcd error
      3  the job failed: every node is marked failed
      4  unknown job: etcd holds no key of the job (a wrong `[job] id`, endpoint
         or key prefix, or a job that never ran against this etcd); the message
         names the job, the endpoints and the jobs that exist there; --json
         prints {"job", "state": "unknown", "error", "jobs", ...} on stdout
      5  the job is stalled: no live node, and not every node failed
    A failed or stalled job's status is printed as any other's. 2 is click's
    own exit status for a bad command line.
    """
    from elasticd.ops.status import (
        NO_SUCH_JOB_EXIT_CODE,
        NoSuchJob,
        exit_code,
        format_status,
        read_status,
    )

    try:
        result = read_status(_load(config_path), events)
    except NoSuchJob as exc:
        click.echo(f"Error: {exc} (config: {config_path})", err=True)
        if as_json:
            click.echo(json.dumps(exc.to_json() | {"config": config_path}, indent=2))
        sys.exit(NO_SUCH_JOB_EXIT_CODE)
    except ElasticdError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(json.dumps(result, indent=2) if as_json else format_status(result))
    sys.exit(exit_code(result))


@main.command()
@click.option("--config", "config_path", required=True, type=click.Path(dir_okay=False))
@click.option("--out", "out_path", default=None, type=click.Path(dir_okay=False),
              help="Draw the timeline into this PNG.")
@click.option("--json", "as_json", is_flag=True, help="Print the timeline as JSON.")
@click.option("--limit", default=100_000, show_default=True,
              help="Read at most this many of the newest journal entries.")
def timeline(config_path: str, out_path: str | None, as_json: bool, limit: int) -> None:
    """The job's history from its etcd journal: nodes, faults, recoveries, steps."""
    from pathlib import Path

    from elasticd.ops.timeline import draw_timeline, format_timeline, read_timeline

    try:
        result = read_timeline(_load(config_path), limit,
                               warn=lambda line: click.echo(f"warning: {line}", err=True))
    except (ElasticdError, ValueError) as exc:
        raise click.ClickException(str(exc)) from None
    if out_path:
        draw_timeline(result, Path(out_path))
        click.echo(f"timeline drawn to {out_path}", err=as_json)
    if as_json:
        click.echo(json.dumps(result, indent=2))
    elif not out_path:
        click.echo(format_timeline(result))


@main.command()
@click.option("--config", "config_path", required=True, type=click.Path(dir_okay=False))
def doctor(config_path: str) -> None:
    """Preflight before joining a node: one ok/warn/FAIL line per check; exit 1 on a FAIL."""
    from elasticd.ops.doctor import exit_code, run_doctor

    sys.exit(exit_code(run_doctor(config_path, echo=click.echo)))


@main.command()
@click.option("--config", "config_path", required=True, type=click.Path(dir_okay=False))
@click.option("--node", "node_id", default=None, help="Node to drain (default: this config's node).")
@click.option("--reason", default="", help="Recorded in the node's log and the job journal.")
def drain(config_path: str, node_id: str | None, reason: str) -> None:
    """Ask a node's daemon to drain: checkpoint, leave the job, exit 0."""
    from elasticd.etcd_client import EtcdClient
    from elasticd.rendezvous.keys import JobKeys

    config = _load(config_path)
    node = node_id or config.node.id
    keys = JobKeys(config.job.id, config.etcd.key_prefix)
    try:
        client = EtcdClient(config.etcd.settings(retry_s=5.0))
        if client.get(keys.node(node)) is None:
            raise click.ClickException(f"node {node!r} is not registered in job {config.job.id!r}; "
                                       "see `elasticd status`")
        client.put(keys.drain(node), json.dumps({"reason": reason}).encode())
        client.close()
    except ElasticdError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"drain requested for node {node}; it leaves after its checkpoint "
               f"(watch with `elasticd status --config {config_path}`)")


def _require_demo_extra() -> None:
    """Fail before the run, not after it: the picture needs matplotlib (the ``demo`` extra)."""
    try:
        import matplotlib  # noqa: F401 - imported later for the picture
    except ImportError:
        raise click.ClickException(
            "the demo draws its timeline with matplotlib, which is not installed; install the "
            "demo extra: pip install 'elasticd[demo]' (or run `make demo` in a checkout)") from None


@main.command()
@click.option("--crash-at", default=30, show_default=True,
              help="Step of the world of 3 at which a node is SIGKILLed.")
@click.option("--rejoin-after", default=1.0, show_default=True,
              help="Seconds of training at world size 2 before the crashed node is restarted.")
@click.option("--drain-after", default=2.0, show_default=True,
              help="Seconds at world size 3 again before another node is drained.")
@click.option("--stop-after", default=1.5, show_default=True,
              help="Seconds of training after the last recovery before each part ends.")
@click.option("--step-sleep", default=0.05, show_default=True, help="Seconds each training step sleeps.")
@click.option("--compare/--no-compare", default=True, show_default=True,
              help="Also run plain torchrun (c10d, tuned) through the same crash.")
@click.option("--out", "out_dir", default=None, type=click.Path(file_okay=False),
              help="Where the summary and the PNG go  [default: ~/elasticd-demo]")
def demo(crash_at: int, rejoin_after: float, drain_after: float, stop_after: float,
         step_sleep: float, compare: bool, out_dir: str | None) -> None:
    """Run a 3-node elastic job on this machine: crash, rejoin, drain; torchrun beside it."""
    from pathlib import Path

    from elasticd.lab.demo import Demo, Settings, format_summary

    if crash_at < 1:
        raise click.BadParameter(f"--crash-at {crash_at} must be at least 1")
    _require_demo_extra()
    out = Path(out_dir).expanduser() if out_dir else Path.home() / "elasticd-demo"
    started = time.monotonic()

    def say(text: str) -> None:
        click.echo(f"[{time.monotonic() - started:6.1f} s] {text}")

    settings = Settings(crash_at=crash_at, rejoin_after=rejoin_after, drain_after=drain_after,
                        stop_after=stop_after, step_sleep=step_sleep, compare=compare)
    try:
        result = Demo(out, settings, say).run()
    except KeyboardInterrupt:
        raise click.ClickException("interrupted; every process and temp file was removed") from None
    except (ElasticdError, TimeoutError) as exc:
        raise click.ClickException(str(exc)) from None
    click.echo("\n" + format_summary(result))
