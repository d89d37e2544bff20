"""Layer 1: the recording schema, the crash-safe Parquet writer, the reader and the replay source."""
