variable "project" {
  type        = string
  description = "GCP project for the learners."
}

variable "region" {
  type        = string
  description = "GCP region of the extra learners."
  default     = "europe-west4"
}

variable "fleet" {
  type        = string
  description = "Fleet id: must equal gcp_fleet in the AWS root (examples/multi-region)."
  default     = "gcp-europe-west4"
}

variable "run_id" {
  type        = string
  description = "Run name (the AWS root's run_id)."
  default     = "run1"
}

variable "store_url" {
  type        = string
  description = "The run's s3://BUCKET/PREFIX (AWS root output store_url)."
}

variable "bucket_region" {
  type        = string
  description = "Home region of the S3 bucket (AWS root output bucket_region)."
}

variable "aws_role_arn" {
  type        = string
  description = "Role the learners assume by web identity (AWS root output gcp_learner_role_arn)."
}

variable "target_size" {
  type        = number
  description = "Spot learners to run in this region."
  default     = 2
}

variable "package_spec" {
  type        = string
  description = "pip requirement(s) that install ddiloco-geo on the VMs."
  default     = "ddiloco-geo"
}

variable "settings" {
  type        = map(string)
  description = "Settings shared with the AWS learners, as DDILOCO_<SECTION>__<FIELD> -> value."
  default = {
    DDILOCO_MODEL__NAME = "small"
  }
}
