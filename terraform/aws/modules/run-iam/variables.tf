variable "name_prefix" {
  type        = string
  description = "Prefix for the IAM role, policy and instance profile names (e.g. the run name)."
}

variable "bucket_name" {
  type        = string
  description = "Name of the run bucket (ARNs are built from the name, so policies are known at plan time)."
}

variable "run_prefix" {
  type        = string
  description = "Run prefix inside the bucket, without slashes at either end."

  validation {
    condition     = can(regex("^[a-z0-9][a-z0-9_-]{0,62}$", var.run_prefix))
    error_message = "run_prefix must be 1-63 characters from a-z, 0-9, '_' and '-' (no slashes)."
  }
}

variable "learner_fleets" {
  type        = list(string)
  description = "One id per learner fleet (e.g. per region). Each fleet gets its own role that may write only learners/<fleet>-*/; learners in a fleet use ids '<fleet>-<instance>'."

  validation {
    condition     = alltrue([for f in var.learner_fleets : can(regex("^[a-z0-9][a-z0-9_-]{0,39}$", f))])
    error_message = "Each fleet id must be 1-40 characters from a-z, 0-9, '_' and '-'."
  }

  validation {
    # "us" and "us-east" would make learners/us-*/ cover learners/us-east-*/: forbid it.
    condition     = alltrue(flatten([for a in var.learner_fleets : [for b in var.learner_fleets : a == b || !startswith(b, "${a}-")]]))
    error_message = "No fleet id may be another fleet id followed by '-' and more characters (its wildcard would cover the other fleet)."
  }
}

variable "kms_key_arn" {
  type        = string
  description = "KMS key that encrypts the bucket (SSE-KMS), granted to every role. Null when the bucket uses SSE-S3."
  default     = null
}

variable "gcp_learner_subjects" {
  type        = map(list(string))
  description = "Fleet id -> Google service-account unique ids allowed to assume that fleet's role by web identity (learners on GCP writing to this S3 bucket). Fleets must also be in learner_fleets."
  default     = {}
}

variable "tags" {
  type        = map(string)
  description = "Tags applied to every IAM resource."
  default     = {}
}
