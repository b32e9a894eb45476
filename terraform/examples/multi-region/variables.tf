variable "run_id" {
  type        = string
  description = "Run name; also the run prefix in the bucket and the prefix of IAM names."
  default     = "run1"
}

variable "bucket_name" {
  type        = string
  description = "Globally unique name of the run bucket (in the home region)."
}

variable "home_region" {
  type        = string
  description = "Home region: the bucket, the syncer and the first learner fleet."
  default     = "us-east-1"
}

variable "second_region" {
  type        = string
  description = "Second learner region (same continent as home)."
  default     = "us-west-2"
}

variable "third_region" {
  type        = string
  description = "Third learner region (another continent)."
  default     = "eu-west-1"
}

variable "learners_per_region" {
  type        = number
  description = "Spot learners to start in each region."
  default     = 2
}

variable "learner_instance_types" {
  type        = list(string)
  description = "Instance types the spot learners may use, most preferred first."
  default     = ["c7i.2xlarge", "c6i.2xlarge", "m7i.2xlarge", "m6i.2xlarge"]
}

variable "package_spec" {
  type        = string
  description = "pip requirement(s) that install ddiloco-geo on the VMs."
  default     = "ddiloco-geo"
}

variable "settings" {
  type        = map(string)
  description = "Settings shared by every agent, as DDILOCO_<SECTION>__<FIELD> -> value (model, fragments, codec...)."
  default = {
    DDILOCO_MODEL__NAME = "small"
  }
}

variable "syncer_settings" {
  type        = map(string)
  description = "Settings for the syncer only, e.g. DDILOCO_SYNCER__QUORUM."
  default = {
    DDILOCO_SYNCER__QUORUM = "2"
  }
}

variable "operator_principal_arns" {
  type        = list(string)
  description = "Principals (besides the learner and syncer roles) allowed to write to the bucket, e.g. your admin role for snapshots and restores."
  default     = []
}

variable "gcp_fleet" {
  type        = string
  description = "Fleet id for the optional GCP learners (examples/multi-region/gcp). Null: no GCP fleet."
  default     = null
}

variable "gcp_learner_subjects" {
  type        = list(string)
  description = "Unique ids of the GCP learners' service account (output of examples/multi-region/gcp), trusted to assume the GCP fleet's role."
  default     = []
}
