"""Checkpoint events and metrics (issue 26), against a real coordinator and metastore, without
Spark: the stats tracker reports what the coordinator did (completions with duration and size,
declines, the consecutive-failure alert, an exceeded ``tolerable_failures``, a restore that fell
back and rescaled), and Airflow's ``Stats`` carries them to a real StatsD listener on loopback.
A listener or metrics backend that fails changes nothing in the attempt."""

from __future__ import annotations

import atexit
import socket
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from airflow.sdk import BaseNotifier

from checkpointing.clock import ManualClock
from checkpointing.config import CheckpointConfig
from checkpointing.coordination.attempt import coordinate_attempt
from checkpointing.coordination.events import (
    CheckpointCompleted,
    CheckpointEvent,
    CheckpointFailed,
    CheckpointingProgress,
    ConsecutiveCheckpointFailures,
    Restored,
    TolerableFailuresExceeded,
)
from checkpointing.coordination.stats_tracker import CheckpointStatsTracker
from checkpointing.metastore.engine import Metastore
from checkpointing.metastore.models import RestoreEvent
from checkpointing.state.storage import FileSystemCheckpointStorage
from checkpointing.status import JobStatus, RestoreStatus
from checkpointing_airflow.alerts import CheckpointAlerts, normalize_alerts
from checkpointing_airflow.metrics import CheckpointMetrics
from tests.helpers import JOB, ack_all, complete, make_plan, new_coordinator, statuses


class Recorder:
    def __init__(self) -> None:
        self.events: list[CheckpointEvent] = []

    def on_event(self, event: CheckpointEvent) -> None:
        self.events.append(event)

    def of(self, kind: type) -> list:
        return [e for e in self.events if isinstance(e, kind)]


class Raising:
    def on_event(self, event: CheckpointEvent) -> None:
        raise RuntimeError("listener down")


@pytest.fixture
def metastore(sqlite_metastore: Metastore) -> Metastore:
    """SQLite only: these tests exercise the logic above the metastore, not its backends."""
    return sqlite_metastore


@pytest.fixture
def statsd() -> Iterator[socket.socket]:
    """A StatsD server's socket on loopback, and Airflow's Stats sending to it (as the task
    runner configures Stats from ``[metrics]``); Stats is reset afterwards."""
    from airflow.sdk._shared.observability.metrics.base_stats_logger import NoStatsLogger
    from airflow.sdk.observability.metrics.stats_utils import get_stats_factory
    from airflow.sdk.observability.stats import Stats

    server = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    server.bind(("127.0.0.1", 0))
    server.settimeout(5)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AIRFLOW__METRICS__STATSD_ON", "True")
        mp.setenv("AIRFLOW__METRICS__STATSD_HOST", "127.0.0.1")
        mp.setenv("AIRFLOW__METRICS__STATSD_PORT", str(server.getsockname()[1]))
        mp.setenv("AIRFLOW__METRICS__STATSD_PREFIX", "airflow")
        Stats.initialize(factory=get_stats_factory(), export_legacy_names=False)
        try:
            yield server
        finally:
            Stats.initialize(factory=NoStatsLogger, export_legacy_names=False)
            server.close()


def received(server: socket.socket) -> list[str]:
    """Every StatsD line received until the socket stays quiet for a moment."""
    lines: list[str] = []
    server.settimeout(0.5)
    while True:
        try:
            data, _ = server.recvfrom(65536)
        except TimeoutError:
            return lines
        lines += data.decode().splitlines()


def test_completions_declines_and_the_failure_threshold_become_events_and_statsd_metrics(
    metastore: Metastore,
    storage: FileSystemCheckpointStorage,
    clock: ManualClock,
    statsd: socket.socket,
) -> None:
    failures: list = []
    coord = new_coordinator(metastore, storage, clock, failures=failures, tolerable_failures=1)
    coord.activate()
    recorder = Recorder()
    tracker = CheckpointStatsTracker(
        JOB,
        metastore,
        "a0",
        [Raising(), recorder, CheckpointMetrics(JOB)],
        failure_alert_threshold=1,
        clock=clock,
    )
    tracker.start()

    pending = coord.trigger_checkpoint()
    clock.advance(2.5)
    assert ack_all(coord, pending).completed is not None
    clock.advance(10)
    tracker.poll()
    (done,) = recorder.of(CheckpointCompleted)
    assert (done.checkpoint_id, done.duration_s, done.is_savepoint) == (1, 2.5, False)
    assert done.state_size > 0 and done.checkpointed_size == done.state_size
    assert recorder.of(CheckpointingProgress)[-1].last_completed_age_s == 10.0

    for _ in range(2):  # two declined checkpoints: the alert at 1, the job fails at 2 > 1
        pending = coord.trigger_checkpoint()
        coord.receive_decline(pending.checkpoint_id, pending.tasks[0].attempt_id)
        tracker.poll()
    failed = recorder.of(CheckpointFailed)
    assert [(f.checkpoint_id, f.reason, f.consecutive_failures) for f in failed] == [
        (2, "CHECKPOINT_DECLINED", 1),
        (3, "CHECKPOINT_DECLINED", 2),
    ]
    (alert,) = recorder.of(ConsecutiveCheckpointFailures)
    assert (alert.count, alert.tolerable_failures, alert.checkpoint_id) == (1, 1, 2)
    (exceeded,) = recorder.of(TolerableFailuresExceeded)
    assert exceeded.count == 2 and "tolerable failure threshold" in (exceeded.cause or "")
    assert failures, "the coordinator failed the job as before"
    tracker.poll()  # nothing is reported twice
    assert len(recorder.of(CheckpointFailed)) == 2
    assert len(recorder.of(TolerableFailuresExceeded)) == 1

    lines = received(statsd)
    assert "airflow.ckpt.checkpoints.completed:1|c" in lines
    assert f"airflow.ckpt.checkpoints.completed.{JOB}:1|c" in lines
    assert f"airflow.ckpt.checkpoint.duration.{JOB}:2500.000000|ms" in lines
    assert f"airflow.ckpt.checkpoint.size.{JOB}:{done.state_size}|g" in lines
    assert f"airflow.ckpt.checkpoints.failed.{JOB}.CHECKPOINT_DECLINED:1|c" in lines
    assert f"airflow.ckpt.checkpoint.consecutive_failures.{JOB}:2|g" in lines
    assert f"airflow.ckpt.checkpoint.last_completed_age.{JOB}:10.0|g" in lines


def test_a_job_failed_on_checkpoint_failures_is_reported_though_its_count_was_reset(
    metastore: Metastore, storage: FileSystemCheckpointStorage, clock: ManualClock
) -> None:
    """The driver fails the job; the operator's loop then stops the scheduler, which resets the
    count, possibly before the watch polls: the job's failure cause still says it."""
    coord = new_coordinator(metastore, storage, clock, failures=[], tolerable_failures=0)
    coord.activate()
    recorder = Recorder()
    tracker = CheckpointStatsTracker(JOB, metastore, "a0", [recorder])
    tracker.start()
    pending = coord.trigger_checkpoint()
    coord.receive_decline(pending.checkpoint_id, pending.tasks[0].attempt_id)
    coord.stop_scheduler()  # resets the consecutive failures
    tracker.poll()
    (exceeded,) = recorder.of(TolerableFailuresExceeded)
    assert (exceeded.count, exceeded.tolerable_failures) == (1, 0)
    tracker.poll()
    assert len(recorder.of(TolerableFailuresExceeded)) == 1


def test_a_restore_that_skipped_a_corrupt_checkpoint_and_rescaled_is_reported_with_its_cost(
    metastore: Metastore,
    storage: FileSystemCheckpointStorage,
    clock: ManualClock,
    statsd: socket.socket,
) -> None:
    coord = new_coordinator(metastore, storage, clock)
    coord.activate()
    for _ in range(2):
        complete(coord)
    recorder = Recorder()
    tracker = CheckpointStatsTracker(
        JOB, metastore, "a1", [recorder, CheckpointMetrics(JOB)], clock=clock
    )
    tracker.start()
    tracker.poll()
    assert recorder.of(Restored) == []  # the driver has not restored yet
    with metastore.transaction() as s:  # what the driver records (RunRestore.restore)
        s.add(
            RestoreEvent(
                job_id=JOB,
                attempt="a1",
                checkpoint_id=1,
                checkpoint_type="CHECKPOINT",
                parallelism=3,
                assignment={"restore_s": 1.25},
                fallbacks={"skipped": [{"checkpoint_id": 2, "reason": "missing file"}]},
                status=RestoreStatus.RESTORED,
                created_at=clock.now(),
            )
        )
    tracker.poll()
    tracker.poll()
    (restored,) = recorder.of(Restored)
    assert restored.checkpoint_id == 1 and restored.skipped == ((2, "missing file"),)
    assert (restored.parallelism, restored.previous_parallelism, restored.rescaled) == (3, 2, True)
    assert restored.duration_s == 1.25
    lines = received(statsd)
    assert "airflow.ckpt.restores:1|c" in lines
    assert f"airflow.ckpt.restore.duration.{JOB}:1250.000000|ms" in lines


def test_the_attempt_reports_its_last_checkpoints_when_it_ends_and_a_failing_watch_changes_nothing(
    metastore: Metastore, storage: FileSystemCheckpointStorage, tmp_path: Path
) -> None:
    recorder = Recorder()
    config = CheckpointConfig()
    tracker = CheckpointStatsTracker(JOB, metastore, "t1", [recorder])
    broken = CheckpointStatsTracker(
        JOB, Metastore(f"sqlite:///{tmp_path}/nowhere/x.db", check_schema=False), "t1", []
    )
    failed_polls: list[BaseException] = []
    poll = broken.poll

    def counted_poll() -> Any:
        try:
            return poll()
        except Exception as exc:
            failed_polls.append(exc)
            raise

    broken.poll = counted_poll  # type: ignore[method-assign]
    tasks = make_plan(attempt="t1")
    with coordinate_attempt(
        JOB,
        metastore,
        storage,
        config,
        attempt="t1",
        tasks=tasks,
        poll=timedelta(hours=1),  # no pass: the last poll alone reports
        failover_reason="t1 failed",
        stats_tracker=tracker,
    ) as coord:
        coord.job_status_changed(JobStatus.RUNNING)
        complete(coord)
    assert [e.checkpoint_id for e in recorder.of(CheckpointCompleted)] == [1]
    with coordinate_attempt(
        JOB,
        metastore,
        storage,
        config,
        attempt="t2",
        tasks=tasks,
        poll=0.01,
        failover_reason="t2 failed",
        stats_tracker=broken,  # its metastore does not exist: every poll fails
    ) as coord:
        deadline = time.monotonic() + 30  # passes of the loop, each followed by a failing poll
        while len(failed_polls) < 3:
            assert time.monotonic() < deadline, "the loop never polled the broken tracker"
            time.sleep(0.01)
        pending = coord.trigger_checkpoint()
        ack_all(coord, pending)  # completed by the ack or by the loop, whichever comes first
    assert statuses(metastore)[pending.checkpoint_id] == "COMPLETED"


def test_a_watcher_after_the_fact_replays_the_attempts_own_checkpoints(
    metastore: Metastore, storage: FileSystemCheckpointStorage
) -> None:
    """A deferred try's end (the triggerer coordinated it): a tracker created then reports the
    attempt's whole history at once, its own checkpoints only, and nothing for an attempt
    that made none."""
    config = CheckpointConfig()
    for attempt, count in (("t1", 2), ("t2", 2)):
        with coordinate_attempt(
            JOB,
            metastore,
            storage,
            config,
            attempt=attempt,
            tasks=make_plan(attempt=attempt),
            poll=timedelta(hours=1),
            failover_reason=f"{attempt} failed",
        ) as coord:
            coord.job_status_changed(JobStatus.RUNNING)
            for _ in range(count):
                complete(coord)
    recorder = Recorder()
    CheckpointStatsTracker(JOB, metastore, "t2", [recorder]).replay()
    assert [e.checkpoint_id for e in recorder.of(CheckpointCompleted)] == [3, 4]
    none = Recorder()
    CheckpointStatsTracker(JOB, metastore, "t3", [none]).replay()
    assert not none.of(CheckpointCompleted) and not none.of(CheckpointFailed)


class FileNotifier(BaseNotifier):
    """A real Airflow notifier: its templated text, rendered with the alert, appended to a file."""

    template_fields = ("text",)

    def __init__(
        self, path: Path, text: str = "{{ checkpoint_alert.kind }}|{{ checkpoint_alert }}"
    ):
        super().__init__()
        self.path = path
        self.text = text

    def notify(self, context: Any) -> None:
        with self.path.open("a") as out:
            out.write(self.text + "\n")


class BrokenNotifier(BaseNotifier):
    def notify(self, context: Any) -> None:
        raise ConnectionError("Slack is down")


def test_checkpoint_trouble_restores_and_savepoints_reach_airflow_notifiers_by_kind(
    metastore: Metastore, storage: FileSystemCheckpointStorage, clock: ManualClock, tmp_path: Path
) -> None:
    everything, failures_only = tmp_path / "all.txt", tmp_path / "failures.txt"
    alerts = CheckpointAlerts(
        JOB,
        normalize_alerts(
            {
                "all": [BrokenNotifier(), FileNotifier(everything)],
                "checkpoint_failures": FileNotifier(failures_only, "{{ checkpoint_alert.reason }}"),
            }
        ),
        {"run_id": "manual__1"},
        "http://airflow/checkpoints/ui/?pipeline=job-a",
    )
    coord = new_coordinator(metastore, storage, clock, tolerable_failures=2)
    coord.activate()
    complete(coord)
    tracker = CheckpointStatsTracker(JOB, metastore, "a1", [alerts], failure_alert_threshold=2)
    tracker.start()
    for _ in range(3):  # the alert at 2 failures, the job fails at 3 > 2
        pending = coord.trigger_checkpoint()
        coord.receive_decline(pending.checkpoint_id, pending.tasks[0].attempt_id)
        tracker.poll()
    complete(coord, savepoint=True)
    with metastore.transaction() as s:
        s.add(
            RestoreEvent(
                job_id=JOB,
                attempt="a1",
                checkpoint_id=1,
                checkpoint_type="CHECKPOINT",
                parallelism=4,
                fallbacks={"skipped": [{"checkpoint_id": 5, "reason": "checksum mismatch"}]},
                status=RestoreStatus.RESTORED,
                created_at=clock.now(),
            )
        )
    tracker.poll()
    alerts.close()  # the notifiers run on the alerts' own thread: wait for them
    kinds = [a.kind for a in alerts.sent]
    assert kinds == [
        "checkpoint_failures",
        "tolerable_failures_exceeded",
        "restore_fallback",
        "restore_rescaled",
        "savepoint_completed",
    ]
    lines = everything.read_text().splitlines()
    assert [line.split("|")[0] for line in lines] == kinds  # the broken notifier changed nothing
    first = lines[0].split("|", 1)[1]
    assert first == (
        "pipeline job-a: 2 consecutive checkpoint failure(s), last checkpoint 3: "
        "CHECKPOINT_DECLINED; the job fails after 3 (tolerable_failures=2). "
        "Checkpoints: http://airflow/checkpoints/ui/?pipeline=job-a"
    )
    assert "skipping unusable ones (checkpoint 5: checksum mismatch)" in lines[2]
    assert "at parallelism 4 (taken at 2)" in lines[3]
    assert failures_only.read_text() == "CHECKPOINT_DECLINED\n"


def test_every_metric_and_alert_kind_is_documented() -> None:
    from checkpointing.pipeline.alerts_spec import ALERT_KINDS
    from checkpointing_airflow.metrics import METRICS, PREFIX

    docs = (Path(__file__).resolve().parents[1] / "docs" / "operations.md").read_text()
    section = docs.split("## Alerts, metrics and lineage", 1)[1].split("\n## ", 1)[0]
    assert [m for m in METRICS if f"`{PREFIX}.{m}`" not in section] == []
    assert [k for k in ALERT_KINDS if f"| `{k}` |" not in section] == []


@pytest.fixture
def otlp() -> Iterator[list[Any]]:
    """An OTLP/HTTP metrics receiver on loopback (what an OpenTelemetry collector is to Airflow),
    and Airflow's Stats exporting to it (``[metrics] otel_on``); the requests it got, decoded."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from airflow.sdk._shared.observability.metrics import otel_logger
    from airflow.sdk._shared.observability.metrics.base_stats_logger import NoStatsLogger
    from airflow.sdk.observability.metrics.stats_utils import get_stats_factory
    from airflow.sdk.observability.stats import Stats
    from opentelemetry import metrics
    from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
        ExportMetricsServiceRequest,
    )

    requests: list[Any] = []

    class Receiver(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            requests.append(ExportMetricsServiceRequest.FromString(body))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Receiver)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AIRFLOW__METRICS__STATSD_ON", "False")
        mp.setenv("AIRFLOW__METRICS__OTEL_ON", "True")
        mp.setenv("AIRFLOW__METRICS__OTEL_HOST", "127.0.0.1")
        mp.setenv("AIRFLOW__METRICS__OTEL_PORT", str(server.server_address[1]))
        mp.setenv("AIRFLOW__METRICS__OTEL_INTERVAL_MILLISECONDS", "600000")
        Stats.initialize(factory=get_stats_factory(), export_legacy_names=False)
        try:
            yield requests
        finally:
            Stats.initialize(factory=NoStatsLogger, export_legacy_names=False)
            # Airflow flushes its meter provider at exit: not this one, shut down now
            atexit.unregister(otel_logger.flush_otel_metrics)
            provider = metrics.get_meter_provider()
            if hasattr(provider, "shutdown"):
                provider.shutdown()
            server.shutdown()


def test_the_metrics_reach_an_opentelemetry_collector_with_the_pipeline_as_attribute(
    otlp: list[Any],
) -> None:
    from opentelemetry import metrics

    stats = CheckpointMetrics(JOB, legacy_names=False)  # the pipeline is an attribute here
    stats.on_event(CheckpointCompleted(JOB, 7, "CHECKPOINT", 1.5, 4096, 1024, "file:///c/chk-7"))
    stats.on_event(CheckpointFailed(JOB, 8, "CHECKPOINT", "CHECKPOINT_EXPIRED", None, 1))
    metrics.get_meter_provider().force_flush()  # type: ignore[attr-defined]
    points: dict[str, list[dict[str, str]]] = {}
    for request in otlp:
        for resource in request.resource_metrics:
            for scope in resource.scope_metrics:
                for metric in scope.metrics:
                    data = getattr(metric, metric.WhichOneof("data"))
                    points.setdefault(metric.name, []).extend(
                        {a.key: a.value.string_value for a in p.attributes}
                        for p in data.data_points
                    )
    assert {"pipeline": JOB} in points["airflow.ckpt.checkpoints.completed"]
    assert {"pipeline": JOB, "reason": "CHECKPOINT_EXPIRED"} in points[
        "airflow.ckpt.checkpoints.failed"
    ]
    assert {"pipeline": JOB} in points["airflow.ckpt.checkpoint.duration"]
    assert {"pipeline": JOB} in points["airflow.ckpt.checkpoint.size"]
    assert not [name for name in points if JOB in name]  # no per-pipeline names
