variable "project" {
  type        = string
  description = "GCP project for the learners."
}

variable "region" {
  type        = string
  description = "Region of the managed instance group (instances spread over its zones)."
}

variable "fleet" {
  type        = string
  description = "Fleet id; learners get ids '<fleet>-<instance name>'."
}

variable "service_account_email" {
  type        = string
  description = "Service account of the learners (run-iam output for a GCS run; any account whose identity AWS trusts for an S3 run)."
}

variable "store_url" {
  type        = string
  description = "Run location: gs://BUCKET/PREFIX, or s3://BUCKET/PREFIX for a run hosted on AWS."
}

variable "bucket_region" {
  type        = string
  description = "Region of the run bucket (settings key storage.region)."
}

variable "run_id" {
  type        = string
  description = "Run name recorded in every object header."
}

variable "web_identity_role_arn" {
  type        = string
  description = "For an S3-hosted run: the AWS role the learners assume with their Google identity token. Null for a GCS run."
  default     = null
}

variable "machine_type" {
  type        = string
  description = "Machine type of the spot learners."
  default     = "c3-standard-8"
}

variable "target_size" {
  type        = number
  description = "Learners to run (the group recreates preempted ones when capacity returns)."
  default     = 2
}

variable "network" {
  type        = string
  description = "VPC network self link or name. Learners get no external IP: the subnet needs Cloud NAT or Private Google Access."
  default     = "default"
}

variable "subnetwork" {
  type        = string
  description = "Subnetwork in the region. Null: the network's auto subnet."
  default     = null
}

variable "image" {
  type        = string
  description = "Boot image with cloud-init (Ubuntu images read the user-data metadata key)."
  default     = "ubuntu-os-cloud/ubuntu-2404-lts-amd64"
}

variable "disk_size_gb" {
  type        = number
  description = "Boot disk size in GB."
  default     = 40
}

variable "package_spec" {
  type        = string
  description = "pip requirement(s) that install the agent."
  default     = "ddiloco-geo"
}

variable "settings" {
  type        = map(string)
  description = "Extra agent settings as environment variables (DDILOCO_<SECTION>__<FIELD> -> value)."
  default     = {}
}

variable "deploy_dir" {
  type        = string
  description = "Directory holding the deploy/ templates. Null: the repository's deploy/."
  default     = null
}

variable "labels" {
  type        = map(string)
  description = "Labels applied to the instances."
  default     = {}
}
