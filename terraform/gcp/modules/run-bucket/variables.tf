variable "project" {
  type        = string
  description = "GCP project that owns the bucket."
}

variable "bucket_name" {
  type        = string
  description = "Globally unique name of the run bucket."
}

variable "location" {
  type        = string
  description = "Bucket location (a region next to the syncer, e.g. europe-west4)."
}

variable "run_prefix" {
  type        = string
  description = "Run prefix inside the bucket, without slashes at either end."
}

variable "delta_prefix" {
  type        = string
  description = "Prefix, relative to the run, under which learners write deltas (keys.LEARNERS)."
  default     = "learners/"
}

variable "delta_expiration_days" {
  type        = number
  description = "Age in days after which objects under the delta prefix are deleted (merged deltas are in merge records)."
  default     = 7
}

variable "noncurrent_version_expiration_days" {
  type        = number
  description = "Days after becoming noncurrent that an object version is deleted."
  default     = 3
}

variable "kms_key_name" {
  type        = string
  description = "Cloud KMS key for default encryption (CMEK). Null: Google-managed encryption."
  default     = null
}

variable "access_log_bucket" {
  type        = string
  description = "Bucket that receives usage logs. Null disables access logging."
  default     = null
}

variable "force_destroy" {
  type        = bool
  description = "Let terraform destroy delete every object. Throwaway runs only."
  default     = false
}

variable "labels" {
  type        = map(string)
  description = "Labels applied to the bucket."
  default     = {}
}
