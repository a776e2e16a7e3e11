"""The web process's side of a GPU call: the service, its jobs, the HTTP gate and the /v1 routes."""
