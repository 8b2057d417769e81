"""Where task records are kept: the interface and the in-memory store (base.py), and the Redis store shared by
several replicas (redis_*.py, resp.py). Nothing is imported here, so a module may use one part (config: the URL rules
of redis_target.py) without loading the rest."""
