variable "name" {
  type        = string
  description = "Name of the syncer VM (Name tag)."
  default     = "ddiloco-syncer"
}

variable "instance_profile_name" {
  type        = string
  description = "Instance profile of the syncer role (IAM module output syncer_instance_profile)."
}

variable "store_url" {
  type        = string
  description = "Run location, s3://BUCKET/PREFIX (bucket module output store_url)."
}

variable "bucket_region" {
  type        = string
  description = "Region of the run bucket; put the syncer in the same region."
}

variable "run_id" {
  type        = string
  description = "Run name recorded in every object header (settings key run_id)."
}

variable "subnet_id" {
  type        = string
  description = "Subnet for the syncer (outbound HTTPS to S3 and the package index)."
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

variable "instance_type" {
  type        = string
  description = "On-demand instance type; the syncer holds the global model and outer-optimizer state in memory."
  default     = "m7i.large"
}

variable "image_id" {
  type        = string
  description = "AMI for the syncer. Null: the latest Ubuntu 24.04 from image_ssm_parameter."
  default     = null
}

variable "image_ssm_parameter" {
  type        = string
  description = "Public SSM parameter that names the AMI when image_id is null."
  default     = "/aws/service/canonical/ubuntu/server/24.04/stable/current/amd64/hvm/ebs-gp3/ami-id"
}

variable "root_volume_gb" {
  type        = number
  description = "Root volume size in GiB."
  default     = 40
}

variable "package_spec" {
  type        = string
  description = "pip requirement(s) that install the agent, e.g. 'ddiloco-geo==0.1.0' or a wheel URL."
  default     = "ddiloco-geo"
}

variable "settings" {
  type        = map(string)
  description = "Extra syncer settings as environment variables (DDILOCO_<SECTION>__<FIELD> -> value), e.g. DDILOCO_SYNCER__QUORUM."
  default     = {}
}

variable "deploy_dir" {
  type        = string
  description = "Directory holding the deploy/ templates. Null: the repository's deploy/."
  default     = null
}

variable "tags" {
  type        = map(string)
  description = "Tags applied to the instance and its volume."
  default     = {}
}
