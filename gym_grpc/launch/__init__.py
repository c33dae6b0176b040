"""Running a configuration: its model and merge (config), the supervisor of its server processes
(runner) or Ray replicas (ray_runner), their logs, what it says about itself (observe), and the
environments configs offer (catalog). `gym-grpc run`, `status` and `envs` are its commands."""
