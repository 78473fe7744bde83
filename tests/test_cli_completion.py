"""Shell completion of ``ckpt`` (issue 40): ``--show-completion`` / ``--install-completion``,
and a real bash sourcing the script completes command names, option values (in the case typed)
and job ids read from the metastore."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from checkpointing.metastore.engine import Metastore
from checkpointing.state.storage import FileSystemCheckpointStorage
from tests.test_cli import CKPT, make_history

BIN = str(Path(CKPT).parent)


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPT_")}
    env.update(HOME=str(tmp_path), PATH=f"{BIN}:{env.get('PATH', '')}", **extra)
    return env


def complete(tmp_path: Path, words: list[str], **env: str) -> list[str]:
    """What bash offers for ``words`` (the last one being completed), through the script
    ``ckpt --show-completion bash`` prints."""
    script = (
        "source <(ckpt --show-completion bash)\n"
        'COMP_WORDS=("$@"); COMP_CWORD=$(( $# - 1 ))\n'
        "_ckpt_completion ckpt\n"
        'printf "%s\\n" "${COMPREPLY[@]}"\n'
    )
    done = subprocess.run(
        ["bash", "--norc", "-c", script, "bash", *words],
        capture_output=True, text=True, env=_env(tmp_path, **env), timeout=180, check=True,
    )  # fmt: skip
    return [line for line in done.stdout.splitlines() if line]


def test_bash_completes_commands_option_values_and_job_ids(tmp_path: Path) -> None:
    assert complete(tmp_path, ["ckpt", "li"]) == ["list", "list-savepoints"]
    assert complete(tmp_path, ["ckpt", "list", "etl", "--status", "co"]) == ["completed"]
    assert complete(tmp_path, ["ckpt", "list", "etl", "--status", "CO"]) == ["COMPLETED"]
    assert "--metastore-url" in complete(tmp_path, ["ckpt", "list", "etl", "--me"])

    url = f"sqlite:///{tmp_path / 'metastore.db'}"
    Metastore(url, check_schema=False).upgrade()
    store = Metastore(url)
    make_history(store, FileSystemCheckpointStorage(f"file://{tmp_path / 'ckpt'}"))
    store.dispose()
    assert complete(tmp_path, ["ckpt", "show", "e"], CKPT_METASTORE_URL=url) == ["etl"]
    assert complete(tmp_path, ["ckpt", "summary", "--metastore-url", url, ""]) == ["etl"]
    # no metastore there: nothing offered, and nothing created
    nowhere = tmp_path / "nowhere"
    assert complete(tmp_path, ["ckpt", "show", ""], CKPT_HOME=str(nowhere)) == []
    assert not nowhere.exists()


def test_install_completion_writes_the_script_for_the_users_shell(tmp_path: Path) -> None:
    done = subprocess.run(
        [CKPT, "--install-completion", "bash"],
        capture_output=True, text=True, env=_env(tmp_path), timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    script = tmp_path / ".bash_completions" / "ckpt.sh"
    assert "_CKPT_COMPLETE=complete_bash" in script.read_text()
    assert str(script) in (tmp_path / ".bashrc").read_text()
