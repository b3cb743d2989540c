"""Prompt sets as users keep them (jsonl, parquet files or folders, `datasets.save_to_disk`
folders), their rows made into records, and the resumable prompt stream the driver draws from."""
