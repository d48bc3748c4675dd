"""Engine replicas on a Ray cluster (`--replicas N`): data parallel, each replica a whole engine. The ray extra.

    options.py   the --replicas flags, their checks, and the one line that says what to install without Ray
    cluster.py   the Ray connection: an existing cluster (--ray-address) or a local one on 127.0.0.1
    batch.py     a batch job's lines answered by N engine actors; a dead one is restarted, its lines retried
    serving.py   the server as a Ray Serve application: engine replicas behind a front that forwards requests
    routing.py   Serve's request router: a shared prompt prefix to one replica, else the least loaded
"""
