variable "endpoint_url" {
  type        = string
  description = "S3/IAM/STS endpoint of the emulator, e.g. http://127.0.0.1:4566 (LocalStack) or a moto server URL."
  default     = "http://127.0.0.1:4566"
}

variable "region" {
  type        = string
  description = "Region name the emulator reports."
  default     = "us-east-1"
}

variable "bucket_name" {
  type        = string
  description = "Name of the run bucket to create."
  default     = "ddiloco-local"
}

variable "run_prefix" {
  type        = string
  description = "Run prefix inside the bucket."
  default     = "run1"
}

variable "learner_fleets" {
  type        = list(string)
  description = "Learner fleet ids; each gets a role that may write only learners/<fleet>-*/."
  default     = ["local-a", "local-b"]
}
