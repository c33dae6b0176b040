"""`gym-grpc report`: what a rollouts file holds (stats), shown (text, plots) and sent on (export)."""
