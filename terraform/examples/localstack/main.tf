# The run bucket and its IAM roles against an S3 emulator on loopback (LocalStack or moto).
# Credentials come from the environment (AWS_ACCESS_KEY_ID=test AWS_SECRET_ACCESS_KEY=test):
# none are written here. Emulators accept but do not enforce IAM and bucket policies; the
# policies are checked structurally by tests/deploy/test_iam_layout.py.

provider "aws" {
  region                      = var.region
  s3_use_path_style           = true
  skip_credentials_validation = true
  skip_metadata_api_check     = true
  skip_requesting_account_id  = true
  skip_region_validation      = true

  endpoints {
    s3  = var.endpoint_url
    iam = var.endpoint_url
    sts = var.endpoint_url
  }
}

module "iam" {
  source = "../../aws/modules/run-iam"

  name_prefix    = var.bucket_name
  bucket_name    = var.bucket_name
  run_prefix     = var.run_prefix
  learner_fleets = var.learner_fleets
}

module "bucket" {
  source = "../../aws/modules/run-bucket"

  bucket_name           = var.bucket_name
  run_prefix            = var.run_prefix
  force_destroy         = true
  writer_principal_arns = module.iam.writer_principal_arns
}
