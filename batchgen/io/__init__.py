"""Reading and writing Parquet/JSONL on fsspec URLs, and the output commit protocol."""
