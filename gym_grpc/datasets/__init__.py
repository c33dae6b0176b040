"""Task files checked, collated and shared: `prepare-data` (prepare), the Hugging Face Hub (hub) and
an MLflow server's model registry (mlflow_store). `gym-grpc prepare-data` and `dataset` are its commands."""
