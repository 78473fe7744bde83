"""The Spark application ``spark-submit`` runs (the Airflow operator's ``application``): the
``ckpt`` command line in a driver launched by spark-submit, e.g.
``spark-submit …/checkpointing/cli/spark_app.py run PIPELINE.yaml --restore 7 --parallelism 4``.
A file of the CLI package, not of :mod:`checkpointing.spark`: the runtime never imports the CLI.
"""

import os
import sys

if __name__ == "__main__":
    # spark-submit puts this file's directory first on sys.path: drop it, so that the modules
    # next to this file (common, data, db, run, …) never shadow top-level packages
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    from checkpointing.cli import main

    sys.argv[0] = "ckpt"
    main()
