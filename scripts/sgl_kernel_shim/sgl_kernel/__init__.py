"""kvtier standing in for ``sgl_kernel`` (kvcacheio only), for running SGLang's own kvcacheio test."""
