"""Rows and files: NeMo Gym JSONL rows <-> gym.v1 messages, rollout files and their statistics, dataset statistics."""
