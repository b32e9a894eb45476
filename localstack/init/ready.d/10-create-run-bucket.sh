#!/bin/bash
# LocalStack init hook (runs inside the container once LocalStack is ready): create the run bucket
# with versioning, as terraform/aws/modules/run-bucket would. Name: $DDILOCO_BUCKET (ddiloco-local).
set -euo pipefail
bucket="${DDILOCO_BUCKET:-ddiloco-local}"
if ! awslocal s3api head-bucket --bucket "$bucket" 2>/dev/null; then
  awslocal s3api create-bucket --bucket "$bucket"
fi
awslocal s3api put-bucket-versioning --bucket "$bucket" --versioning-configuration Status=Enabled
echo "ddiloco run bucket ready: s3://${bucket} (endpoint http://127.0.0.1:4566)"
