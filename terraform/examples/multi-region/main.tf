# One run across three AWS regions on two continents: the bucket and the syncer in the home region,
# a spot learner fleet in each region (one provider alias per region). Optional GCP learners join
# from examples/multi-region/gcp (its own root: the google provider is not needed here).

provider "aws" {
  alias  = "home"
  region = var.home_region
}

provider "aws" {
  alias  = "second"
  region = var.second_region
}

provider "aws" {
  alias  = "third"
  region = var.third_region
}

locals {
  fleets = {
    home   = "aws-${var.home_region}"
    second = "aws-${var.second_region}"
    third  = "aws-${var.third_region}"
  }
  all_fleets   = concat(values(local.fleets), var.gcp_fleet == null ? [] : [var.gcp_fleet])
  tags         = { "ddiloco-run" = var.run_id }
  agent_config = merge(var.settings, { DDILOCO_STORAGE__TIMEOUT_S = "20" })
}

# --- home region: bucket, IAM, syncer ------------------------------------------------------------

module "iam" {
  source    = "../../aws/modules/run-iam"
  providers = { aws = aws.home }

  name_prefix          = "ddiloco-${var.run_id}"
  bucket_name          = var.bucket_name
  run_prefix           = var.run_id
  learner_fleets       = local.all_fleets
  gcp_learner_subjects = var.gcp_fleet == null || length(var.gcp_learner_subjects) == 0 ? {} : { (var.gcp_fleet) = var.gcp_learner_subjects }
  tags                 = local.tags
}

module "bucket" {
  source    = "../../aws/modules/run-bucket"
  providers = { aws = aws.home }

  bucket_name           = var.bucket_name
  run_prefix            = var.run_id
  writer_principal_arns = concat(module.iam.writer_principal_arns, var.operator_principal_arns)
  tags                  = local.tags
}

data "aws_vpc" "home" {
  provider = aws.home
  default  = true
}

data "aws_subnets" "home" {
  provider = aws.home

  filter {
    name   = "vpc-id"
    values = [data.aws_vpc.home.id]
  }
}

module "syncer" {
  source    = "../../aws/modules/syncer"
  providers = { aws = aws.home }

  instance_profile_name = module.iam.syncer_instance_profile
  store_url             = module.bucket.store_url
  bucket_region         = var.home_region
  run_id                = var.run_id
  vpc_id                = data.aws_vpc.home.id
  subnet_id             = data.aws_subnets.home.ids[0]
  package_spec          = var.package_spec
  settings              = merge(local.agent_config, var.syncer_settings)
  tags                  = local.tags
}

module "learners_home" {
  source    = "../../aws/modules/learner-fleet"
  providers = { aws = aws.home }

  fleet                 = local.fleets.home
  instance_profile_name = module.iam.learner_instance_profiles[local.fleets.home]
  role_name             = module.iam.learner_role_names[local.fleets.home]
  store_url             = module.bucket.store_url
  bucket_region         = var.home_region
  run_id                = var.run_id
  vpc_id                = data.aws_vpc.home.id
  subnet_ids            = data.aws_subnets.home.ids
  instance_types        = var.learner_instance_types
  desired_capacity      = var.learners_per_region
  package_spec          = var.package_spec
  settings              = local.agent_config
  tags                  = local.tags
}

# --- second region -------------------------------------------------------------------------------

data "aws_vpc" "second" {
  provider = aws.second
  default  = true
}

data "aws_subnets" "second" {
  provider = aws.second

  filter {
    name   = "vpc-id"
    values = [data.aws_vpc.second.id]
  }
}

module "learners_second" {
  source    = "../../aws/modules/learner-fleet"
  providers = { aws = aws.second }

  fleet                 = local.fleets.second
  instance_profile_name = module.iam.learner_instance_profiles[local.fleets.second]
  role_name             = module.iam.learner_role_names[local.fleets.second]
  store_url             = module.bucket.store_url
  bucket_region         = var.home_region
  run_id                = var.run_id
  vpc_id                = data.aws_vpc.second.id
  subnet_ids            = data.aws_subnets.second.ids
  instance_types        = var.learner_instance_types
  desired_capacity      = var.learners_per_region
  package_spec          = var.package_spec
  settings              = local.agent_config
  tags                  = local.tags
}

# --- third region (another continent) ------------------------------------------------------------

data "aws_vpc" "third" {
  provider = aws.third
  default  = true
}

data "aws_subnets" "third" {
  provider = aws.third

  filter {
    name   = "vpc-id"
    values = [data.aws_vpc.third.id]
  }
}

module "learners_third" {
  source    = "../../aws/modules/learner-fleet"
  providers = { aws = aws.third }

  fleet                 = local.fleets.third
  instance_profile_name = module.iam.learner_instance_profiles[local.fleets.third]
  role_name             = module.iam.learner_role_names[local.fleets.third]
  store_url             = module.bucket.store_url
  bucket_region         = var.home_region
  run_id                = var.run_id
  vpc_id                = data.aws_vpc.third.id
  subnet_ids            = data.aws_subnets.third.ids
  instance_types        = var.learner_instance_types
  desired_capacity      = var.learners_per_region
  package_spec          = var.package_spec
  settings              = local.agent_config
  tags                  = local.tags
}
