"""batchline under an orchestrator: an Airflow provider (`batchline.orchestrators.airflow`,
the `airflow` extra) and Dagster assets and checks (`batchline.orchestrators.dagster`, the
`dagster` extra). Both plan a version with the task's key, launch its fleet once
(`batchline.launch.fleet`), wait for its seal without holding a worker, then validate and
publish it; neither computes a record itself."""
