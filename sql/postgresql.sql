-- Reference DDL of the checkpoint metastore for postgresql, revision 0008.
-- Generated from checkpointing/metastore/models.py by `make ddl`; `ckpt db upgrade`
-- (Alembic) is the supported way to create or migrate a metastore. A test fails when
-- they drift.

CREATE TABLE ckpt_driver_grants (
	role_name VARCHAR(63) NOT NULL,
	job_id VARCHAR(128) NOT NULL,
	attempt VARCHAR(64) NOT NULL,
	expires_at TIMESTAMP WITH TIME ZONE NOT NULL,
	PRIMARY KEY (role_name)
);

CREATE TABLE ckpt_jobs (
	job_id VARCHAR(128) NOT NULL,
	status VARCHAR(16) NOT NULL,
	storage_url VARCHAR(2048) NOT NULL,
	interval_ms BIGINT,
	timeout_ms BIGINT NOT NULL,
	min_pause_ms BIGINT NOT NULL,
	max_concurrent INTEGER NOT NULL,
	tolerable_failures INTEGER NOT NULL,
	retained INTEGER NOT NULL,
	retention VARCHAR(32) NOT NULL,
	prefer_checkpoint_for_recovery BOOLEAN NOT NULL,
	savepoint_keep INTEGER,
	savepoint_max_age_ms BIGINT,
	next_checkpoint_id BIGINT NOT NULL,
	periodic_scheduling BOOLEAN NOT NULL,
	coordinator_id VARCHAR(64),
	consecutive_failures INTEGER NOT NULL,
	last_completed_id BIGINT,
	last_completion_at TIMESTAMP WITH TIME ZONE,
	heartbeat_at TIMESTAMP WITH TIME ZONE,
	refresh_checkpoint_id BIGINT,
	refresh_token VARCHAR(256),
	driver_attempt VARCHAR(64),
	driver_host VARCHAR(255),
	driver_pid INTEGER,
	driver_parallelism INTEGER,
	driver_log VARCHAR(2048),
	driver_submitted_at TIMESTAMP WITH TIME ZONE,
	driver_watcher VARCHAR(64),
	failure_cause TEXT,
	status_by VARCHAR(80),
	created_at TIMESTAMP WITH TIME ZONE NOT NULL,
	updated_at TIMESTAMP WITH TIME ZONE NOT NULL,
	PRIMARY KEY (job_id)
);

CREATE TABLE ckpt_requests (
	request_id SERIAL NOT NULL,
	job_id VARCHAR(128) NOT NULL,
	checkpoint_type VARCHAR(24) NOT NULL,
	forced BOOLEAN NOT NULL,
	periodic BOOLEAN NOT NULL,
	priority INTEGER NOT NULL,
	requested_by VARCHAR(256) NOT NULL,
	requested_at TIMESTAMP WITH TIME ZONE NOT NULL,
	target_location VARCHAR(2048),
	status VARCHAR(16) NOT NULL,
	checkpoint_id BIGINT,
	message TEXT,
	finished_at TIMESTAMP WITH TIME ZONE,
	PRIMARY KEY (request_id),
	FOREIGN KEY(job_id) REFERENCES ckpt_jobs (job_id) ON DELETE CASCADE
);

CREATE INDEX ix_ckpt_requests_job_status ON ckpt_requests (job_id, status);

CREATE TABLE ckpt_restores (
	restore_id SERIAL NOT NULL,
	job_id VARCHAR(128) NOT NULL,
	attempt VARCHAR(256) NOT NULL,
	checkpoint_id BIGINT,
	checkpoint_type VARCHAR(24),
	external_path VARCHAR(2048),
	parallelism INTEGER,
	assignment JSONB,
	fallbacks JSONB,
	status VARCHAR(16) NOT NULL,
	message TEXT,
	created_at TIMESTAMP WITH TIME ZONE NOT NULL,
	PRIMARY KEY (restore_id),
	FOREIGN KEY(job_id) REFERENCES ckpt_jobs (job_id) ON DELETE CASCADE
);

CREATE INDEX ix_ckpt_restores_job ON ckpt_restores (job_id, restore_id);

CREATE TABLE ckpt_shared_state (
	job_id VARCHAR(128) NOT NULL,
	checkpoint_id BIGINT NOT NULL,
	handle VARCHAR(2048) NOT NULL,
	size BIGINT NOT NULL,
	PRIMARY KEY (job_id, checkpoint_id, handle),
	FOREIGN KEY(job_id) REFERENCES ckpt_jobs (job_id) ON DELETE CASCADE
);

CREATE INDEX ix_ckpt_shared_state_job_handle ON ckpt_shared_state (job_id, handle);

CREATE TABLE ckpt_checkpoints (
	job_id VARCHAR(128) NOT NULL,
	checkpoint_id BIGINT NOT NULL,
	checkpoint_type VARCHAR(24) NOT NULL,
	status VARCHAR(16) NOT NULL,
	periodic BOOLEAN NOT NULL,
	forced BOOLEAN NOT NULL,
	discard_on_subsumed BOOLEAN NOT NULL,
	discard_on_finished BOOLEAN NOT NULL,
	discard_on_cancelled BOOLEAN NOT NULL,
	discard_on_failed BOOLEAN NOT NULL,
	discard_on_suspended BOOLEAN NOT NULL,
	trigger_at TIMESTAMP WITH TIME ZONE NOT NULL,
	deadline_at TIMESTAMP WITH TIME ZONE NOT NULL,
	completed_at TIMESTAMP WITH TIME ZONE,
	ended_at TIMESTAMP WITH TIME ZONE,
	num_tasks INTEGER NOT NULL,
	storage_location VARCHAR(2048) NOT NULL,
	metadata_path VARCHAR(2048),
	metadata_checksum VARCHAR(80),
	state_size BIGINT NOT NULL,
	checkpointed_size BIGINT DEFAULT '0' NOT NULL,
	failure_reason VARCHAR(64),
	failure_message TEXT,
	coordinator_id VARCHAR(64),
	completing_by VARCHAR(64),
	notified_at TIMESTAMP WITH TIME ZONE,
	notify_error TEXT,
	request_id INTEGER,
	PRIMARY KEY (job_id, checkpoint_id),
	FOREIGN KEY(job_id) REFERENCES ckpt_jobs (job_id) ON DELETE CASCADE,
	FOREIGN KEY(request_id) REFERENCES ckpt_requests (request_id) ON DELETE SET NULL
);

CREATE INDEX ix_ckpt_checkpoints_job_status ON ckpt_checkpoints (job_id, status);

CREATE TABLE ckpt_checkpoint_tasks (
	job_id VARCHAR(128) NOT NULL,
	checkpoint_id BIGINT NOT NULL,
	attempt_id VARCHAR(128) NOT NULL,
	operator_id VARCHAR(128) NOT NULL,
	subtask_index INTEGER NOT NULL,
	parallelism INTEGER NOT NULL,
	max_parallelism INTEGER NOT NULL,
	PRIMARY KEY (job_id, checkpoint_id, attempt_id),
	FOREIGN KEY(job_id, checkpoint_id) REFERENCES ckpt_checkpoints (job_id, checkpoint_id) ON DELETE CASCADE,
	UNIQUE (job_id, checkpoint_id, operator_id, subtask_index)
);

CREATE TABLE ckpt_checkpoint_acks (
	job_id VARCHAR(128) NOT NULL,
	checkpoint_id BIGINT NOT NULL,
	attempt_id VARCHAR(128) NOT NULL,
	state_handle VARCHAR(2048),
	state_size BIGINT NOT NULL,
	checksum VARCHAR(80),
	sync_ms INTEGER NOT NULL,
	async_ms INTEGER NOT NULL,
	acked_at TIMESTAMP WITH TIME ZONE NOT NULL,
	state_meta JSONB,
	PRIMARY KEY (job_id, checkpoint_id, attempt_id),
	FOREIGN KEY(job_id, checkpoint_id, attempt_id) REFERENCES ckpt_checkpoint_tasks (job_id, checkpoint_id, attempt_id) ON DELETE CASCADE
);

CREATE TABLE alembic_version (
	version_num VARCHAR(32) NOT NULL,
	CONSTRAINT alembic_version_pkc PRIMARY KEY (version_num)
);
INSERT INTO alembic_version (version_num) VALUES ('0008');
