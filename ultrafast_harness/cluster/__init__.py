"""The cluster's harness: its ingress bench, relay timers, the fleet simulator and the
`ultrafast cluster` child-process runner (the ingress itself is `ultrafast/cluster/`)."""
