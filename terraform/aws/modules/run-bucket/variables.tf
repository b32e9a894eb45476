variable "bucket_name" {
  type        = string
  description = "Globally unique name of the run bucket."
}

variable "run_prefix" {
  type        = string
  description = "Run prefix inside the bucket (the part after the bucket in s3://BUCKET/PREFIX), without slashes at either end."

  validation {
    condition     = can(regex("^[a-z0-9][a-z0-9_-]{0,62}$", var.run_prefix))
    error_message = "run_prefix must be 1-63 characters from a-z, 0-9, '_' and '-' (no slashes)."
  }
}

variable "delta_prefix" {
  type        = string
  description = "Prefix, relative to the run, under which learners write deltas (keys.LEARNERS). S3 lifecycle filters are literal prefixes, so the expiry rule covers this whole prefix."
  default     = "learners/"
}

variable "delta_expiration_days" {
  type        = number
  description = "Age in days after which objects under the delta prefix expire. Merged deltas are recorded in the syncer's merge records; a live learner rewrites its heartbeat long before this age."
  default     = 7

  validation {
    condition     = var.delta_expiration_days >= 1
    error_message = "delta_expiration_days must be at least 1."
  }
}

variable "noncurrent_version_expiration_days" {
  type        = number
  description = "Age in days after which noncurrent (overwritten or deleted) object versions are removed."
  default     = 3

  validation {
    condition     = var.noncurrent_version_expiration_days >= 1
    error_message = "noncurrent_version_expiration_days must be at least 1."
  }
}

variable "kms_key_arn" {
  type        = string
  description = "KMS key for server-side encryption (SSE-KMS). Null uses SSE-S3 (AES256); the IAM module then needs no KMS grants."
  default     = null
}

variable "writer_principal_arns" {
  type        = list(string)
  description = "IAM principal ARNs allowed to write or delete objects (learner and syncer roles, plus any operator role). Empty: no deny-others statement in the bucket policy."
  default     = []
}

variable "access_log_bucket" {
  type        = string
  description = "Bucket that receives S3 server access logs. Null disables access logging."
  default     = null
}

variable "force_destroy" {
  type        = bool
  description = "Let terraform destroy delete every object version in the bucket. Use only for throwaway runs (examples/localstack)."
  default     = false
}

variable "tags" {
  type        = map(string)
  description = "Tags applied to the bucket."
  default     = {}
}
