"""AWS through boto3: EKS access (tokens, cluster endpoints); images, CodeBuild and ECR later."""
