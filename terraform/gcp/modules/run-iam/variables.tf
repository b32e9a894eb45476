variable "project" {
  type        = string
  description = "GCP project for the service accounts."
}

variable "bucket_name" {
  type        = string
  description = "Name of the GCS run bucket."
}

variable "run_prefix" {
  type        = string
  description = "Run prefix inside the bucket, without slashes at either end."
}

variable "learner_fleets" {
  type        = list(string)
  description = "One id per learner fleet; each gets a service account that may write only learners/<fleet>-*/."
}
