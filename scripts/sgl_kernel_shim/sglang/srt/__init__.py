"""Only what SGLang's kvcacheio test asks of SGLang (see ../../README.md)."""
