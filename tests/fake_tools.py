"""Stand-ins for tools this machine lacks, for tests that run the CLI end to end."""

# A stand-in for the Docker CLI (no Docker engine runs here): `push` puts an image manifest into the
# registry (moto's ECR), `inspect` answers with the repo digest the registry gave it, as Docker does;
# `info` and `buildx build` succeed; `run IMAGE CMD...` runs CMD here (this environment is the image).
FAKE_DOCKER = """#!{python}
import json, os, sys
import boto3
ecr = boto3.client("ecr", region_name="us-west-2", endpoint_url=os.environ["FSDPKIT_AWS_ENDPOINT_URL"])
cmd = sys.argv[1]
if cmd == "login":
    sys.stdin.read()
elif cmd == "run":
    args = sys.argv[2:]
    while args[0].startswith("-"):
        args = args[2:] if args[0] == "--gpus" else args[1:]
    os.execvp(args[1], args[1:])
elif cmd in ("push", "inspect"):
    uri = sys.argv[-1]
    repo, tag = uri.split("/", 1)[1].rsplit(":", 1)
    if cmd == "push":
        ecr.put_image(repositoryName=repo, imageTag=tag, imageManifest=json.dumps({{"schemaVersion": 2,
            "mediaType": "application/vnd.docker.distribution.manifest.v2+json", "config": {{"size": 1,
            "mediaType": "application/vnd.docker.container.image.v1+json", "digest": "sha256:" + "1" * 64}},
            "layers": []}}))
    else:
        image = ecr.describe_images(repositoryName=repo, imageIds=[{{"imageTag": tag}}])["imageDetails"][0]
        print(uri.rsplit(":", 1)[0] + "@" + image["imageDigest"])
"""
