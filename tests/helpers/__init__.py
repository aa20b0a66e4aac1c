"""What the tests share, each defined once: data and operands, servers, pools, caches, models, CLI runs."""
