variable "fleet" {
  type        = string
  description = "Fleet id (as in the IAM module's learner_fleets). Learners get ids '<fleet>-<instance id>'."
}

variable "instance_profile_name" {
  type        = string
  description = "Instance profile of this fleet's learner role (IAM module output learner_instance_profiles[fleet])."
}

variable "role_name" {
  type        = string
  description = "Name of this fleet's learner role; the module adds permission to complete its own lifecycle hook."
}

variable "store_url" {
  type        = string
  description = "Run location, s3://BUCKET/PREFIX (bucket module output store_url)."
}

variable "bucket_region" {
  type        = string
  description = "Region of the run bucket (learners in other regions still reach it there)."
}

variable "run_id" {
  type        = string
  description = "Run name recorded in every object header (settings key run_id)."
}

variable "region_label" {
  type        = string
  description = "Region label learners report in status views. Null: the fleet's AWS region."
  default     = null
}

variable "subnet_ids" {
  type        = list(string)
  description = "Subnets (ideally one per availability zone) the fleet may launch into. They need outbound HTTPS to S3 and the package index."
}

variable "vpc_id" {
  type        = string
  description = "VPC of the subnet(s); the module creates an egress-only security group there (HTTPS and HTTP out, nothing in)."
}

variable "security_group_ids" {
  type        = list(string)
  description = "Extra security groups to attach besides the module's egress-only group."
  default     = []
}

variable "instance_types" {
  type        = list(string)
  description = "Instance types the spot fleet may use, most preferred first. More types mean more spot pools to draw from."
  default     = ["c7i.2xlarge", "c6i.2xlarge", "m7i.2xlarge", "m6i.2xlarge"]
}

variable "min_size" {
  type        = number
  description = "Minimum number of learners."
  default     = 0
}

variable "max_size" {
  type        = number
  description = "Maximum number of learners."
  default     = 8
}

variable "desired_capacity" {
  type        = number
  description = "Learners to run now. Raise it (or add a fleet) to add scavenged spot capacity to a running job."
  default     = 2
}

variable "on_demand_base_capacity" {
  type        = number
  description = "Learners kept on demand regardless of spot (0: all spot)."
  default     = 0
}

variable "on_demand_percentage_above_base" {
  type        = number
  description = "Percentage of learners above the base that run on demand (0: all spot)."
  default     = 0
}

variable "lifecycle_hook_timeout_s" {
  type        = number
  description = "Seconds a terminating learner is held (Terminating:Wait) so the agent can flush before the VM goes; the agent completes the hook earlier when done."
  default     = 120
}

variable "image_id" {
  type        = string
  description = "AMI for the learners. Null: the latest Ubuntu 24.04 from image_ssm_parameter in the fleet's region."
  default     = null
}

variable "image_ssm_parameter" {
  type        = string
  description = "Public SSM parameter that names the AMI when image_id is null."
  default     = "/aws/service/canonical/ubuntu/server/24.04/stable/current/amd64/hvm/ebs-gp3/ami-id"
}

variable "root_volume_gb" {
  type        = number
  description = "Root volume size in GiB (Python, PyTorch and the data cache)."
  default     = 40
}

variable "package_spec" {
  type        = string
  description = "pip requirement(s) that install the agent, e.g. 'ddiloco-geo==0.1.0' or a wheel URL."
  default     = "ddiloco-geo"
}

variable "settings" {
  type        = map(string)
  description = "Extra agent settings as environment variables (DDILOCO_<SECTION>__<FIELD> -> value), e.g. DDILOCO_MODEL__NAME."
  default     = {}
}

variable "deploy_dir" {
  type        = string
  description = "Directory holding the deploy/ templates (unit, cloud-init, env, scripts). Null: the repository's deploy/."
  default     = null
}

variable "tags" {
  type        = map(string)
  description = "Tags applied to the launch template, the group and (propagated) the instances."
  default     = {}
}
