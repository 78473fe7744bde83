"""``daily_revenue``: the step-checkpointed script ``daily_revenue.py`` beside this file
(docs/steps.md, "Deploy it as a DAG") as an Airflow task.

spark-submit runs the script through ``ckpt run``, so its ``checkpointed(spark,
job="daily_revenue")`` makes each step a checkpoint (the join's chained, the others written); a
failed try is retried, and the retry resumes from the job's latest checkpoint (completed steps
reused: read back, or the chained join recomputed inside the step that reads it) at
``parallelism_on_retry``. The job is the DAG's id, and one run at a time runs it. Copy both
files into a DAGs folder, or serve this one: ``python -m demo airflow --dags examples/steps``.
Trigger with the paths of your data.
"""

from datetime import datetime, timedelta

from airflow.sdk import DAG, Param

from checkpointing_airflow.operators import CheckpointedSparkSubmitOperator

with DAG(
    "daily_revenue",
    schedule=None,
    start_date=datetime(2026, 1, 1),
    catchup=False,
    # one run at a time: two runs' drivers would each take the one job from the other
    max_active_runs=1,
    params={
        "orders": Param("/data/orders", type="string", description="orders (Parquet)"),
        "customers": Param("/data/customers", type="string", description="customers (Parquet)"),
        "out": Param("/data/daily_revenue", type="string", description="the output's folder"),
        "parallelism": Param(2, type="integer", minimum=1),
        "parallelism_on_retry": Param(4, type="integer", minimum=1),
    },
):
    CheckpointedSparkSubmitOperator(
        task_id="run",
        application="daily_revenue.py",  # relative: this DAG file's folder
        # job: the DAG's id, "daily_revenue", what the script's checkpointed(spark, job=...) names
        application_args=["{{ params.orders }}", "{{ params.customers }}", "{{ params.out }}"],
        parallelism="{{ params.parallelism }}",
        parallelism_on_retry="{{ params.parallelism_on_retry }}",
        retries=2,
        retry_delay=timedelta(seconds=5),
        conf={"spark.ui.showConsoleProgress": "false"},
    )
