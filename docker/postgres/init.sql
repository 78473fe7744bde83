-- First start of the compose PostgreSQL: one database for Airflow, one for the checkpoint
-- metastore (docker-compose.yml's AIRFLOW__DATABASE__SQL_ALCHEMY_CONN and
-- AIRFLOW_CONN_CHECKPOINT_METASTORE / CKPT_METASTORE_URL), each owned by its own role.
CREATE ROLE airflow LOGIN PASSWORD 'airflow';
CREATE DATABASE airflow OWNER airflow;
CREATE ROLE ckpt LOGIN PASSWORD 'ckpt';
CREATE DATABASE ckpt OWNER ckpt;
