"""Scale-out: N engine replicas behind one OpenAI ingress (`ultrafast cluster`, on Ray Serve).

router.py, shared_limits.py and simulate.py are plain Python (no Ray): the ingress and the
simulation share the router. app.py and cli_cluster.py need the optional extra
`ultrafast[ray]`; nothing under ultrafast/server imports this package.
"""
