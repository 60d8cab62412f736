"""Scale-out: N engine replicas behind one OpenAI ingress (`ultrafast cluster`, on Ray Serve).

router.py, ingress.py, ingress_app.py and shared_limits.py are plain Python (no Ray); the
fleet simulator (ultrafast_harness/cluster/simulate.py) shares the router. replica.py and run.py
need the optional extra `ultrafast[ray]`; its flags are ultrafast/cli_cluster.py. Nothing
under ultrafast/server imports this package.
"""
