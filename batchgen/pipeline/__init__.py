"""Job spec, prompt rendering, length bucketing and the job runner."""
