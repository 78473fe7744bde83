"""What the operator reads of the Spark provider's ``SparkSubmitHook`` beyond its public API.

The hook exposes neither the connection it resolved (master, deploy mode: the operator refuses
a deploy mode that would put credentials on the command line), nor spark-submit's exit code (the
failed try's log line names the signal that killed the driver), nor the environment it gives
spark-submit (the deferrable task starts spark-submit itself); all are private attributes.
The reads stay here, one function each, and ``tests/test_provider_package.py`` checks
:data:`PRIVATE_ATTRIBUTES` on a real hook, so a provider upgrade that renames them fails there
rather than silently treating every deploy mode as ``client``.
"""

from __future__ import annotations

from typing import Any

#: the hook's private attributes read here (checked by tests/test_provider_package.py)
PRIVATE_ATTRIBUTES = ("_connection", "_submit_sp", "_env")


def submit_target(hook: Any) -> tuple[str, str | None]:
    """The deploy mode (``client`` when unset) and the master the hook submits to."""
    connection = getattr(hook, "_connection", {}) or {}
    return str(connection.get("deploy_mode") or "client"), connection.get("master")


def submit_returncode(hook: Any) -> int | None:
    """spark-submit's exit code (negative: the signal that ended it), None when it did not run
    or has not ended."""
    process = getattr(hook, "_submit_sp", None)
    return getattr(process, "returncode", None)


def submit_environment(hook: Any) -> dict[str, str]:
    """The variables the hook would add to spark-submit's environment (``env_vars`` in client
    mode outside YARN and Kubernetes), for a caller that starts spark-submit itself."""
    return {k: str(v) for k, v in (getattr(hook, "_env", None) or {}).items()}
