"""`fsdpkit infra create|status|delete`: exactly what the image build path needs, nothing more: an S3
bucket for build contexts, a least-privilege IAM role for CodeBuild, a CloudWatch log group, the
CodeBuild project and the ECR repository. Idempotent, tagged, with a plan printed before changes;
`delete` removes only what carries fsdpkit's tag. The same resources as a CloudFormation template."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

from fsdpkit import yamlfile
from fsdpkit.aws.session import Aws, aws_errors

TAG_KEY, TAG_VALUE = "fsdpkit:managed", "true"
LOG_GROUP = "/fsdpkit/codebuild"
PROJECT = "fsdpkit-image-build"
CODEBUILD_IMAGE = "aws/codebuild/standard:7.0"


@dataclass
class Names:
    bucket: str
    role: str
    log_group: str
    project: str
    repository: str

    @classmethod
    def of(cls, aws: Aws, repository: str = "fsdpkit") -> Names:
        # Account and region from the session: bucket names are global, so they must be unique per account.
        return cls(f"fsdpkit-build-{aws.account}-{aws.region}", f"fsdpkit-codebuild-{aws.region}", LOG_GROUP,
                   PROJECT, repository)

    def resources(self) -> list[str]:
        """Every resource `create` makes, as plans and `status` name them."""
        return [f"s3 bucket {self.bucket}", f"iam role {self.role}", f"log group {self.log_group}",
                f"codebuild project {self.project}", f"ecr repository {self.repository}"]


def buildspec() -> dict[str, Any]:
    """CodeBuild's instructions, from code: log in to ECR, build, run the image's own selftest, push."""
    return {
        "version": 0.2,
        "env": {"shell": "bash"},
        "phases": {
            "pre_build": {"commands": [
                "REGISTRY=${IMAGE_URI%%/*}",
                "aws ecr get-login-password --region $AWS_REGION | docker login --username AWS --password-stdin "
                "$REGISTRY",
            ]},
            "build": {"commands": [
                "docker build -t $IMAGE_URI .",
                "docker run --rm $IMAGE_URI fsdpkit selftest --level ${SELFTEST_LEVEL:-quick}",
            ]},
            "post_build": {"commands": [
                'if [ "$CODEBUILD_BUILD_SUCCEEDING" = "1" ]; then docker push $IMAGE_URI; fi',
            ]},
        },
    }


def role_policy(aws: Aws, n: Names) -> dict[str, Any]:
    arn = f"arn:aws:%s:{aws.region}:{aws.account}:%s"
    return {"Version": "2012-10-17", "Statement": [
        {"Effect": "Allow", "Action": ["logs:CreateLogStream", "logs:PutLogEvents"],
         "Resource": arn % ("logs", f"log-group:{n.log_group}:*")},
        {"Effect": "Allow", "Action": ["s3:GetObject", "s3:GetObjectVersion"],
         "Resource": f"arn:aws:s3:::{n.bucket}/*"},
        {"Effect": "Allow", "Action": ["ecr:GetAuthorizationToken"], "Resource": "*"},
        {"Effect": "Allow", "Action": ["ecr:BatchCheckLayerAvailability", "ecr:InitiateLayerUpload",
                                       "ecr:UploadLayerPart", "ecr:CompleteLayerUpload", "ecr:PutImage",
                                       "ecr:BatchGetImage", "ecr:GetDownloadUrlForLayer"],
         "Resource": arn % ("ecr", f"repository/{n.repository}")},
    ]}


TRUST = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Principal": {"Service": "codebuild.amazonaws.com"},
                                                  "Action": "sts:AssumeRole"}]}
LIFECYCLE = {"rules": [{"rulePriority": 1, "description": "keep the newest 50 images",
                        "selection": {"tagStatus": "any", "countType": "imageCountMoreThan", "countNumber": 50},
                        "action": {"type": "expire"}}]}


class Infra:
    def __init__(self, aws: Aws, repository: str = "fsdpkit", immutable_tags: bool = False):
        self.aws, self.n, self.immutable = aws, Names.of(aws, repository), immutable_tags
        self.s3, self.iam, self.logs = aws.client("s3"), aws.client("iam"), aws.client("logs")
        self.ecr, self.cb = aws.client("ecr"), aws.client("codebuild")

    # -- what exists -------------------------------------------------------------------------------
    def status(self) -> dict[str, bool]:
        n = self.n
        with aws_errors("listing buckets", "s3"):
            bucket = n.bucket in {b["Name"] for b in self.s3.list_buckets().get("Buckets", [])}
        with aws_errors("reading the role", "iam"):
            role = n.role in {r["RoleName"] for page in self.iam.get_paginator("list_roles").paginate()
                              for r in page["Roles"]}
        with aws_errors("listing log groups", "logs"):
            groups = self.logs.describe_log_groups(logGroupNamePrefix=n.log_group).get("logGroups", [])
        with aws_errors("reading the CodeBuild project", "codebuild"):
            project = bool(self.cb.batch_get_projects(names=[n.project]).get("projects"))
        with aws_errors("listing repositories", "ecr"):
            repos = {r["repositoryName"] for r in self.ecr.describe_repositories().get("repositories", [])}
        found = (bucket, role, any(g["logGroupName"] == n.log_group for g in groups), project, n.repository in repos)
        return dict(zip(n.resources(), found, strict=True))

    # -- create ----------------------------------------------------------------------------------------
    def create(self, say: Callable[[str], None] = print, dry_run: bool = False) -> list[str]:
        """Create what is missing, in dependency order; returns what was created (with `dry_run`,
        what would be, creating nothing)."""
        have = self.status()
        plan = [k for k, v in have.items() if not v]
        say(("dry run: " if dry_run else "") + "plan: " + ("create " + ", ".join(plan) if plan else
                                                          "nothing to do (everything exists)"))
        if dry_run:
            return plan
        n, created = self.n, []
        tags_kv = [{"Key": TAG_KEY, "Value": TAG_VALUE}]
        if not have[f"s3 bucket {n.bucket}"]:
            with aws_errors(f"creating bucket {n.bucket}", "s3"):
                kw = {} if self.aws.region == "us-east-1" else {
                    "CreateBucketConfiguration": {"LocationConstraint": self.aws.region}}
                self.s3.create_bucket(Bucket=n.bucket, **kw)
                self.s3.put_bucket_tagging(Bucket=n.bucket, Tagging={"TagSet": tags_kv})
                self.s3.put_public_access_block(Bucket=n.bucket, PublicAccessBlockConfiguration={
                    "BlockPublicAcls": True, "IgnorePublicAcls": True, "BlockPublicPolicy": True,
                    "RestrictPublicBuckets": True})
            created.append(f"s3 bucket {n.bucket}")
        if not have[f"log group {n.log_group}"]:
            with aws_errors(f"creating log group {n.log_group}", "logs"):
                self.logs.create_log_group(logGroupName=n.log_group, tags={TAG_KEY: TAG_VALUE})
                self.logs.put_retention_policy(logGroupName=n.log_group, retentionInDays=30)
            created.append(f"log group {n.log_group}")
        if not have[f"ecr repository {n.repository}"]:
            with aws_errors(f"creating repository {n.repository}", "ecr"):
                self.ecr.create_repository(repositoryName=n.repository, tags=tags_kv,
                                           imageScanningConfiguration={"scanOnPush": True},
                                           imageTagMutability="IMMUTABLE" if self.immutable else "MUTABLE")
                self.ecr.put_lifecycle_policy(repositoryName=n.repository, lifecyclePolicyText=json.dumps(LIFECYCLE))
            created.append(f"ecr repository {n.repository}")
        if not have[f"iam role {n.role}"]:
            with aws_errors(f"creating role {n.role}", "iam"):
                self.iam.create_role(RoleName=n.role, AssumeRolePolicyDocument=json.dumps(TRUST), Tags=tags_kv,
                                     Description="fsdpkit: CodeBuild builds and pushes training images")
                self.iam.put_role_policy(RoleName=n.role, PolicyName="fsdpkit-codebuild",
                                         PolicyDocument=json.dumps(role_policy(self.aws, n)))
            created.append(f"iam role {n.role}")
        if not have[f"codebuild project {n.project}"]:
            role_arn = f"arn:aws:iam::{self.aws.account}:role/{n.role}"
            with aws_errors(f"creating project {n.project}", "codebuild"):
                self.cb.create_project(
                    name=n.project, serviceRole=role_arn, tags=[{"key": TAG_KEY, "value": TAG_VALUE}],
                    source={"type": "S3", "location": f"{n.bucket}/context.zip",
                            "buildspec": yamlfile.dump(buildspec())},
                    artifacts={"type": "NO_ARTIFACTS"},
                    environment={"type": "LINUX_CONTAINER", "image": CODEBUILD_IMAGE,
                                 "computeType": "BUILD_GENERAL1_LARGE", "privilegedMode": True},
                    logsConfig={"cloudWatchLogs": {"status": "ENABLED", "groupName": n.log_group}})
            created.append(f"codebuild project {n.project}")
        return created

    # -- delete --------------------------------------------------------------------------------------
    def delete(self, say: Callable[[str], None] = print, delete_images: bool = False,
             dry_run: bool = False) -> list[str]:
        """Remove what `create` made (fsdpkit's names and tag), newest first; nothing else. A repository
        that still holds images is kept unless `delete_images`: images are not ours to lose. With
        `dry_run`, what would be removed, removing nothing."""
        have, n, removed = self.status(), self.n, []
        if dry_run:
            plan = [k for k, v in have.items() if v]
            repo = f"ecr repository {n.repository}"
            if repo in plan and not (self._repo_is_ours() and (delete_images or not self._images())):
                plan.remove(repo)
            say("dry run: would remove " + (", ".join(plan) or "nothing (none of fsdpkit's resources exist)"))
            return plan
        if have[f"codebuild project {n.project}"]:
            with aws_errors("deleting the project", "codebuild"):
                self.cb.delete_project(name=n.project)
            removed.append(f"codebuild project {n.project}")
        if have[f"iam role {n.role}"]:
            with aws_errors("deleting the role", "iam"):
                for p in self.iam.list_role_policies(RoleName=n.role).get("PolicyNames", []):
                    self.iam.delete_role_policy(RoleName=n.role, PolicyName=p)
                self.iam.delete_role(RoleName=n.role)
            removed.append(f"iam role {n.role}")
        if have[f"ecr repository {n.repository}"] and self._repo_is_ours() and self._repository_goes(say,
                                                                                                     delete_images):
            removed.append(f"ecr repository {n.repository}")
        if have[f"log group {n.log_group}"]:
            with aws_errors("deleting the log group", "logs"):
                self.logs.delete_log_group(logGroupName=n.log_group)
            removed.append(f"log group {n.log_group}")
        if have[f"s3 bucket {n.bucket}"]:
            self._delete_bucket()
            removed.append(f"s3 bucket {n.bucket}")
        say("removed: " + (", ".join(removed) or "nothing (none of fsdpkit's resources exist)"))
        return removed

    def _repository_goes(self, say: Callable[[str], None], delete_images: bool) -> bool:
        """Delete our repository unless it holds images and `delete_images` was not given (said)."""
        images = self._images()
        if images and not delete_images:
            say(f"kept ecr repository {self.n.repository}: it holds {len(images)} image(s) "
                "(pass --delete-images to remove them too)")
            return False
        with aws_errors("deleting the repository", "ecr"):
            self.ecr.delete_repository(repositoryName=self.n.repository, force=True)
        return True

    def _delete_bucket(self) -> None:
        """Every version and delete marker of the bucket, then the bucket."""
        bucket = self.n.bucket
        with aws_errors("emptying and deleting the bucket", "s3"):
            for page in self.s3.get_paginator("list_object_versions").paginate(Bucket=bucket):
                for o in page.get("Versions", []) + page.get("DeleteMarkers", []):
                    self.s3.delete_object(Bucket=bucket, Key=o["Key"], VersionId=o["VersionId"])
            self.s3.delete_bucket(Bucket=bucket)

    def _images(self) -> list[dict[str, Any]]:
        with aws_errors("listing the repository's images", "ecr"):
            images = self.ecr.list_images(repositoryName=self.n.repository).get("imageIds", [])
            return cast("list[dict[str, Any]]", images)

    def _repo_is_ours(self) -> bool:
        with aws_errors("reading repository tags", "ecr"):
            arn = self.ecr.describe_repositories(repositoryNames=[self.n.repository])["repositories"][0][
                "repositoryArn"]
            tags = self.ecr.list_tags_for_resource(resourceArn=arn).get("tags", [])
        return {"Key": TAG_KEY, "Value": TAG_VALUE} in tags


def cloudformation(repository: str = "fsdpkit") -> dict[str, Any]:
    """The same resources as `infra create`, for users who deploy with CloudFormation."""
    tags = [{"Key": TAG_KEY, "Value": TAG_VALUE}]
    bucket = {"Fn::Sub": "fsdpkit-build-${AWS::AccountId}-${AWS::Region}"}
    return {
        "AWSTemplateFormatVersion": "2010-09-09",
        "Description": "fsdpkit image build path: S3 context bucket, CodeBuild role, log group, project, ECR repo",
        "Resources": {
            "ContextBucket": {"Type": "AWS::S3::Bucket", "Properties": {
                "BucketName": bucket, "Tags": tags, "PublicAccessBlockConfiguration": {
                    "BlockPublicAcls": True, "IgnorePublicAcls": True, "BlockPublicPolicy": True,
                    "RestrictPublicBuckets": True}}},
            "BuildLogs": {"Type": "AWS::Logs::LogGroup", "Properties": {"LogGroupName": LOG_GROUP,
                                                                         "RetentionInDays": 30}},
            "Repository": {"Type": "AWS::ECR::Repository", "Properties": {
                "RepositoryName": repository, "ImageScanningConfiguration": {"ScanOnPush": True},
                "LifecyclePolicy": {"LifecyclePolicyText": json.dumps(LIFECYCLE)}, "Tags": tags}},
            "BuildRole": {"Type": "AWS::IAM::Role", "Properties": {
                "RoleName": {"Fn::Sub": "fsdpkit-codebuild-${AWS::Region}"}, "AssumeRolePolicyDocument": TRUST,
                "Tags": tags, "Policies": [{"PolicyName": "fsdpkit-codebuild", "PolicyDocument": {
                    "Version": "2012-10-17", "Statement": [
                        {"Effect": "Allow", "Action": ["logs:CreateLogStream", "logs:PutLogEvents"],
                         "Resource": {"Fn::Sub": f"arn:aws:logs:${{AWS::Region}}:${{AWS::AccountId}}:log-group:"
                                                 f"{LOG_GROUP}:*"}},
                        {"Effect": "Allow", "Action": ["s3:GetObject", "s3:GetObjectVersion"],
                         "Resource": {"Fn::Sub": "arn:aws:s3:::fsdpkit-build-${AWS::AccountId}-${AWS::Region}/*"}},
                        {"Effect": "Allow", "Action": ["ecr:GetAuthorizationToken"], "Resource": "*"},
                        {"Effect": "Allow", "Action": ["ecr:BatchCheckLayerAvailability", "ecr:InitiateLayerUpload",
                                                       "ecr:UploadLayerPart", "ecr:CompleteLayerUpload",
                                                       "ecr:PutImage", "ecr:BatchGetImage",
                                                       "ecr:GetDownloadUrlForLayer"],
                         "Resource": {"Fn::GetAtt": ["Repository", "Arn"]}}]}}]}},
            "Project": {"Type": "AWS::CodeBuild::Project", "Properties": {
                "Name": PROJECT, "ServiceRole": {"Fn::GetAtt": ["BuildRole", "Arn"]}, "Tags": tags,
                "Source": {"Type": "S3", "Location": {"Fn::Sub": "fsdpkit-build-${AWS::AccountId}-${AWS::Region}"
                                                                 "/context.zip"},
                           "BuildSpec": yamlfile.dump(buildspec())},
                "Artifacts": {"Type": "NO_ARTIFACTS"},
                "Environment": {"Type": "LINUX_CONTAINER", "Image": CODEBUILD_IMAGE,
                                "ComputeType": "BUILD_GENERAL1_LARGE", "PrivilegedMode": True},
                "LogsConfig": {"CloudWatchLogs": {"Status": "ENABLED", "GroupName": LOG_GROUP}}}},
        },
    }
