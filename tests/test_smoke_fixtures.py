from checkpointing.metastore.engine import Metastore


def test_metastore_fixture_is_migrated(metastore: Metastore) -> None:
    assert metastore.current_revision() == Metastore.head_revision()
